"""How balanced a set of workers (or pipeline stages) is.

The product's headline metric (from the seed document): for per-worker times Tᵢ of one
step, balance = 1 − (max Tᵢ − min Tᵢ) / max Tᵢ. 1.0 is perfect; 0.5 means the fastest
worker idles half of the step. Idle fraction says the same thing in rank-seconds: the
share of all workers' time spent waiting for the slowest one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poise.balance.costs import fit_alpha, measured_speeds


def balance(times: Sequence[float] | np.ndarray) -> float:
    """1 − (max − min) / max of per-worker times in seconds (1.0 for one worker or all zero).

    Raises:
        ValueError: if ``times`` is empty or holds a negative or non-finite value.
    """
    t = np.asarray(times, dtype=np.float64)
    if t.size == 0:
        raise ValueError("balance() needs at least one time, got none")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"balance() needs finite times >= 0 seconds, got {t.tolist()}")
    top = float(t.max())
    return 1.0 if top == 0.0 else 1.0 - (top - float(t.min())) / top


def idle_fraction(compute_s: np.ndarray) -> float:
    """Share of rank-seconds spent waiting for the slowest rank.

    Args:
        compute_s: array ``[steps, ranks]`` of each rank's compute seconds per step.

    Returns:
        Σ_steps Σ_ranks (max_rank T − T) / Σ_steps (ranks · max_rank T), in [0, 1).
    """
    t = np.asarray(compute_s, dtype=np.float64)
    if t.ndim != 2 or t.size == 0:
        raise ValueError(f"idle_fraction() needs a [steps, ranks] array, got shape {t.shape}")
    slowest = t.max(axis=1, keepdims=True)
    total = float((slowest * t.shape[1]).sum())
    return 0.0 if total == 0.0 else float((slowest - t).sum()) / total


def balance_ceiling(samples: np.ndarray, padded_tokens: np.ndarray, compute_s: np.ndarray) -> float | None:
    """The mean per-step balance that a perfect plan would reach over these steps: what the
    scatter of one step's time around each rank's cost model leaves, which no plan can remove.

    Why: a dynamic balancer moves shares to equalise the ranks' *expected* times; a step's own
    time then strays from its expectation (cache, clocks, a CPU quota's slices) and that part
    of the imbalance is noise. Next to the measured balance, this says how much of the gap to
    1.0 is the plan's and how much the machine's: on a 2-core machine the per-step log time
    ratio of two ranks scattered by 0.08-0.19 between runs (``poise bench balance``), which
    caps the mean balance near 0.89-0.96 whatever the shares.

    How: each rank's step time is modelled as its padded cost ``n·Lmax + α·n·Lmax²`` (α fitted
    in relative error, :func:`~poise.balance.costs.fit_alpha`) over its speed (geometric mean,
    :func:`~poise.balance.costs.measured_speeds`), fitted on the even steps and scored on the
    odd ones and the other way round (an in-sample fit would call part of the noise model).
    Each rank's mean log residual is taken out (a perfect plan also knows the true speeds); a
    step's ceiling is then :func:`balance` of the exponentiated residuals.

    Args:
        samples, padded_tokens, compute_s: ``[ranks, steps]`` per step: samples, padded
            tokens (``n·Lmax`` when a step's batch is one padded tensor) and compute seconds.

    Returns:
        The ceiling in [0, 1], or None with fewer than 8 steps where every rank measured a time.
    """
    n, p, t = (np.asarray(a, dtype=np.float64) for a in (samples, padded_tokens, compute_s))
    if not n.shape == p.shape == t.shape or n.ndim != 2:
        raise ValueError(f"balance_ceiling() needs three [ranks, steps] arrays, got {n.shape}, {p.shape}, {t.shape}")
    usable = np.all((n > 0) & (p > 0) & (t > 0) & np.isfinite(t), axis=0)
    n, p, t = n[:, usable], p[:, usable], t[:, usable]
    if t.shape[1] < 8:
        return None
    q = p * p / n  # n·Lmax²
    residual = np.empty_like(t)
    steps = np.arange(t.shape[1])
    for fold in (0, 1):
        fit, score = steps % 2 != fold, steps % 2 == fold
        for r in range(t.shape[0]):
            alpha = fit_alpha(p[r, fit], q[r, fit], t[r, fit]) or 0.0
            cost = p[r] + alpha * q[r]
            speed = measured_speeds(cost[None, fit], t[None, r, fit])[0]
            residual[r, score] = np.log(t[r, score] * speed / cost[score])
    residual -= residual.mean(axis=1, keepdims=True)
    return float(np.mean([balance(np.exp(col)) for col in residual.T]))
