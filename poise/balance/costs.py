"""What a sample costs and how fast a rank is, from metadata and measured step times.

Cost is computed from each sample's length alone, never by loading it. For attention models a
sample of L tokens costs L + α·L² (linear layers scale with L, attention with L²); for
convolutional or MLP tasks L. Costs are in "token units": a rank's speed is cost units per
second of its own compute, so speeds of different ranks compare directly and only their
ratios matter to the planner.

α is known in advance only roughly (≈ 1/(6·d_model) from counting FLOPs); :func:`fit_alpha`
refines it from measured step times by least squares in relative error, t ≈ a·ΣL + b·ΣL², α = b/a.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CostFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class AttentionCost:
    """cost(L) = L + alpha·L² in token units (alpha = 0 gives the linear cost)."""

    alpha: float = 0.0

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        length = np.asarray(lengths, dtype=np.float64)
        return length + self.alpha * length * length


def as_cost_fn(fn: Callable[..., object]) -> CostFn:
    """A vectorised cost function from ``fn``, which may take one length (a number) or an array.

    Planners call cost functions with arrays of lengths. A user's ``lambda L: float(L)`` or a
    function with an ``if`` on its argument only works on one number; such a function is
    applied element by element (slower: about a microsecond per sample and call). Which kind
    ``fn`` is is decided once, here, by calling it on two lengths.

    Raises:
        ValueError: when ``fn`` returns something that is not one finite cost >= 0 per length.
    """
    if isinstance(fn, AttentionCost):
        return fn
    probe = np.array([1.0, 2.0])
    vectorised = True
    try:
        out = np.asarray(fn(probe), dtype=np.float64)
        vectorised = out.shape == probe.shape
    except (TypeError, ValueError):
        vectorised = False
    cost = _Vectorised(fn) if vectorised else _Elementwise(fn)
    try:
        checked = cost(probe)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cost_fn must map a length to one finite cost >= 0; for lengths 1 and 2 it failed: "
                         f"{exc}") from None
    if checked.shape != probe.shape or not np.all(np.isfinite(checked)) or np.any(checked < 0):
        raise ValueError(f"cost_fn must map a length to one finite cost >= 0; for lengths 1 and 2 it gave "
                         f"{checked.tolist()}")
    return cost


@dataclass(frozen=True)
class _Vectorised:
    fn: Callable[..., object]

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        return np.asarray(self.fn(np.asarray(lengths, dtype=np.float64)), dtype=np.float64)


@dataclass(frozen=True)
class _Elementwise:
    fn: Callable[..., object]

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        values = np.asarray(lengths).ravel()
        return np.fromiter((float(self.fn(v)) for v in values.tolist()), dtype=np.float64, count=len(values))


def linear_cost() -> AttentionCost:
    """cost(L) = L: the cost of convolutional and MLP tasks."""
    return AttentionCost(0.0)


def padded_cost(cost_fn: CostFn, lengths: np.ndarray) -> float:
    """Cost of one batch padded to its longest sample: n · cost(max L)."""
    if len(lengths) == 0:
        return 0.0
    return float(len(lengths) * cost_fn(np.asarray([np.max(lengths)]))[0])


def fit_alpha(linear_terms: np.ndarray, quadratic_terms: np.ndarray, times_s: np.ndarray) -> float | None:
    """Least-squares α from per-step (ΣL, ΣL², seconds) of one rank.

    Fits t = a·ΣL + b·ΣL² (no intercept: an empty batch costs nothing) in *relative* error,
    each step weighted by 1/t, and returns b/a, or None when the data cannot tell (too few
    steps, no spread in lengths, or a fit that is not physical: a ≤ 0 or b < 0).

    Why relative: a step's balance is a ratio of the ranks' times, so a cost model is as good
    as its relative error per step. Fitted in seconds, the few steps of many short samples
    (2.5 s against 0.8 s for most steps of code-lm) decided α: over one whole run the fit in
    seconds gave the full-speed rank α = 5.9·10⁻⁵ and its half-speed peer 4.0·10⁻⁴, the fit
    in relative error 3.4·10⁻⁴ and 5.1·10⁻⁴ (``poise bench balance``, run c, ``runs/s38-abc``).
    """
    x = np.stack([np.asarray(linear_terms, float), np.asarray(quadratic_terms, float)], axis=1)
    t = np.asarray(times_s, dtype=np.float64)
    if len(t) < 4 or not np.all(np.isfinite(x)) or not np.all(np.isfinite(t)) or np.any(t <= 0):
        return None
    x = x / t[:, None]  # rows of x·(a, b) ≈ 1: relative residuals
    # Scale columns so the solve is well conditioned (ΣL² is ~1000x ΣL).
    scale = np.abs(x).max(axis=0)
    if np.any(scale == 0):
        return None
    coef, *_ = np.linalg.lstsq(x / scale, np.ones(len(t)), rcond=None)
    a, b = coef / scale
    if a <= 0 or b < 0:
        return None
    return float(b / a)


def measured_speeds(cost_s: np.ndarray, compute_s: np.ndarray) -> np.ndarray:
    """Per-rank speed in cost units per second: the geometric mean, over a window of steps, of
    each step's cost / compute seconds.

    Why not Σ cost / Σ compute seconds: that weights each step by its length in time, so it
    predicts a window's total time, while a step's balance is the ratio of the ranks' times in
    *that* step. The geometric mean centres each step's predicted log time ratio on zero: on
    one run of ``poise bench balance`` (c, ``runs/s38-abc``) the ratio estimate left rank 1
    2.5 % slower than predicted on average, the geometric mean 0.9 % (replayed offline on that
    run's timeline).

    Args:
        cost_s: ``[ranks, steps]`` cost units each rank processed per step.
        compute_s: ``[ranks, steps]`` each rank's compute seconds per step.

    Steps where a rank measured no time or no cost are left out of that rank's mean.

    Raises:
        ValueError: if a rank has no step with both.
    """
    cost = np.asarray(cost_s, dtype=np.float64)
    seconds = np.asarray(compute_s, dtype=np.float64)
    valid = (seconds > 0) & (cost > 0) & np.isfinite(seconds) & np.isfinite(cost)
    if not np.all(valid.any(axis=1)):
        raise ValueError(f"cannot estimate speeds: cost {cost.sum(axis=1).tolist()}, "
                         f"seconds {seconds.sum(axis=1).tolist()}")
    log_speed = np.log(np.where(valid, cost, 1.0) / np.where(valid, seconds, 1.0))
    return np.exp(np.where(valid, log_speed, 0.0).sum(axis=1) / valid.sum(axis=1))
