"""Pipeline stage partitioning: pure functions from per-layer costs to stage boundaries.

A plan is the list of boundary offsets ``[0, b₁, …, n]`` (length ``num_stages + 1``): stage
``k`` runs layers ``b_k … b_{k+1} − 1``. Every rank can compute the same plan from the same
numbers without communicating; executing it is the pipeline runner's job. How many stages
and micro-batches to use is :mod:`poise.balance.stage_count`'s.

Stage time model (seconds): the compute of the stage's layers plus the communication of the
cuts it touches. A cut after layer ``i`` moves the activation forward and its gradient
backward, and both neighbouring stages are busy with it (one sends, one receives), so the
cut's cost ``boundary_costs[i]`` (e.g. 2 · bytes / link bandwidth) is charged to both.

Methods (one dict, :data:`METHODS`):

- ``exact``: minimises the slowest stage (the bottleneck), then, among the plans with that
  bottleneck, maximises the fastest stage, hence the balance 1 − (max − min) / max. Dynamic
  programming over (stages, prefix): O(p · n²) time and O(p · n) memory for n layers and p
  stages (two passes). Optional per-stage memory cap, per-cut communication costs and
  inseparable layer groups. The linear partition problem; see Bokhari, "Partitioning
  problems in parallel, pipelined and distributed computing", IEEE ToC 1988, and PipeDream
  (Narayanan et al., SOSP 2019) for the communication-aware variant.
- ``uniform``: equal layer counts (DeepSpeed ``partition_method='uniform'``), O(p).
- ``parameters``: min-max partition of ``weights`` (parameter counts), the rule of DeepSpeed's
  ``'parameters'`` and PiPPy's split by size, O(p · n²).
- ``greedy``: one pass cutting where the running cost is nearest k/p of the total, the
  block-partition heuristic users write by hand (in the spirit of torchgpipe's
  ``balance_by_time``), O(n).

The baselines ignore memory, communication and inseparable groups (they do not know them):
passing those to a baseline is an error, and :func:`describe_plan` evaluates any plan with them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from poise.balance.metrics import balance
from poise.config import PARTITION_METHODS

_REL_TOL = 1e-9  # float slack when re-checking a stage against the optimal bottleneck


@dataclass(frozen=True)
class PlanSummary:
    """What a plan predicts.

    Attributes:
        boundaries: stage boundary offsets, length ``num_stages + 1``.
        stage_s: predicted seconds of each stage (compute + its cuts' communication).
        bottleneck_s: the slowest stage's seconds; it sets the pipeline's pace.
        balance: 1 − (max − min) / max over ``stage_s``.
        stage_memory_bytes: summed ``memory`` per stage, when memory was given.
    """

    boundaries: list[int]
    stage_s: list[float]
    bottleneck_s: float
    balance: float
    stage_memory_bytes: list[float] | None = None


# ----------------------------------------------------------------------------- validation


def _vector(name: str, values: Sequence[float] | np.ndarray, *, length: int | None, positive: bool) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"{name} must be a flat list of numbers, got shape {v.shape}")
    if length is not None and v.size != length:
        raise ValueError(f"{name} has {v.size} entries; need {length}")
    bad = ~np.isfinite(v) | ((v <= 0) if positive else (v < 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{name}[{i}]={float(v[i])!r} is invalid: every entry must be finite and {need}")
    return v


def _check_stage_count(num_layers: int, num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, (int, np.integer)) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} is invalid: need an integer >= 1")
    if num_layers == 0:
        raise ValueError("costs is empty: need at least one layer")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} is more than the {num_layers} layers: every stage needs a layer")


def _cut_allowed(num_layers: int, inseparable: Iterable[Iterable[int]]) -> np.ndarray:
    """``allowed[i]``: may a stage start at layer ``i``? (0 and n always may.)"""
    allowed = np.ones(num_layers + 1, dtype=bool)
    for group in inseparable:
        members = sorted(int(i) for i in group)
        if not members:
            continue
        if members[0] < 0 or members[-1] >= num_layers:
            raise ValueError(f"inseparable group {members} names a layer outside 0..{num_layers - 1}")
        allowed[members[0] + 1 : members[-1] + 1] = False  # no cut between its first and last layer
    return allowed


def check_boundaries(boundaries: Sequence[int], num_layers: int) -> list[int]:
    """Validate a plan: starts at 0, ends at ``num_layers``, strictly increasing.

    Raises:
        ValueError: naming the offending boundaries.
    """
    b = [int(x) for x in boundaries]
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in itertools.pairwise(b)):
        raise ValueError(
            f"boundaries {b} are invalid: need 0 = b0 < b1 < ... < {num_layers} (one or more layers per stage)"
        )
    return b


# ----------------------------------------------------------------------------- evaluation


def _cut_costs(num_layers: int, boundary_costs: np.ndarray | None) -> np.ndarray:
    """``cut[i]``: seconds a stage pays for a boundary at offset i (0 at both ends)."""
    cut = np.zeros(num_layers + 1)
    if boundary_costs is not None:
        cut[1:num_layers] = boundary_costs
    return cut


def stage_times(
    costs: Sequence[float], boundaries: Sequence[int], *, boundary_costs: Sequence[float] | None = None
) -> list[float]:
    """Predicted seconds of each stage of a plan: its layers' costs plus its cuts' communication.

    Args:
        costs: seconds per layer (forward + backward).
        boundaries: the plan, as returned by :func:`partition`.
        boundary_costs: seconds per possible cut (``len(costs) − 1``; entry i is the cut after
            layer i), or None for free communication.
    """
    c = _vector("costs", costs, length=None, positive=False)
    b = check_boundaries(boundaries, c.size)
    comm = None if boundary_costs is None else _vector("boundary_costs", boundary_costs, length=c.size - 1,
                                                       positive=False)
    cut = _cut_costs(c.size, comm)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    return [float(prefix[j] - prefix[i] + cut[i] + cut[j]) for i, j in itertools.pairwise(b)]


def describe_plan(
    costs: Sequence[float],
    boundaries: Sequence[int],
    *,
    boundary_costs: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
) -> PlanSummary:
    """A plan's predicted stage seconds, bottleneck, balance and (optionally) memory per stage."""
    times = stage_times(costs, boundaries, boundary_costs=boundary_costs)
    b = [int(x) for x in boundaries]
    stage_memory = None
    if memory is not None:
        m = np.concatenate([[0.0], np.cumsum(_vector("memory", memory, length=len(costs), positive=False))])
        stage_memory = [float(m[j] - m[i]) for i, j in itertools.pairwise(b)]
    return PlanSummary(b, times, max(times), balance(times), stage_memory)


def all_plans(num_layers: int, num_stages: int) -> Iterable[list[int]]:
    """Every plan of ``num_layers`` layers into ``num_stages`` stages: C(n − 1, p − 1) of them.

    The brute-force reference that tests and ``poise bench partition`` check the exact method
    against on small cases; O(C(n − 1, p − 1) · p).
    """
    _check_stage_count(num_layers, num_stages)
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        yield [0, *cuts, num_layers]


# ----------------------------------------------------------------------------- exact


def _min_max_plan(
    values: np.ndarray,
    num_stages: int,
    *,
    cut: np.ndarray,
    allowed: np.ndarray,
    memory: np.ndarray | None,
    memory_cap: float | None,
) -> list[int] | None:
    """Plan minimising the largest stage (then maximising the smallest); None when infeasible.

    Stage [i, j) weighs ``prefix[j] − prefix[i] + cut[i] + cut[j]``. Pass 1 finds the optimal
    bottleneck B*; pass 2 maximises the smallest stage over plans whose stages are all ≤ B*.
    """
    n = values.size
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    mem = None if memory is None else np.concatenate([[0.0], np.cumsum(memory)])
    starts = np.flatnonzero(allowed[:n])  # offsets where a stage may start

    def row(j: int) -> tuple[np.ndarray, np.ndarray]:
        i = starts[starts < j]
        cost = prefix[j] - prefix[i] + cut[i] + cut[j]
        if mem is not None and memory_cap is not None:
            cost = np.where(mem[j] - mem[i] <= memory_cap, cost, np.inf)
        return i, cost

    ends = [j for j in range(1, n + 1) if allowed[j]]
    rows = {j: row(j) for j in ends}

    # Pass 1: best[k][j] = smallest bottleneck of layers [0, j) in k stages.
    best = np.full((num_stages + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
        for j in ends if k < num_stages else [n]:
            i, cost = rows[j]
            if i.size:
                best[k, j] = np.min(np.maximum(best[k - 1, i], cost))
    bottleneck = best[num_stages, n]
    if not np.isfinite(bottleneck):
        return None
    limit = bottleneck + _REL_TOL * max(abs(bottleneck), 1e-300)

    # Pass 2: most[k][j] = largest possible smallest stage, every stage <= the bottleneck.
    most = np.full((num_stages + 1, n + 1), -np.inf)
    most[0, 0] = np.inf
    choice = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    for k in range(1, num_stages + 1):
        for j in ends if k < num_stages else [n]:
            i, cost = rows[j]
            if not i.size:
                continue
            cand = np.where(cost <= limit, np.minimum(most[k - 1, i], cost), -np.inf)
            pick = int(np.argmax(cand))
            most[k, j] = cand[pick]
            choice[k, j] = i[pick]
    assert np.isfinite(most[num_stages, n]), "pass 2 must find the plan pass 1 proved exists"
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(int(choice[k, bounds[-1]]))
    return bounds[::-1]


def _exact(
    costs: np.ndarray,
    num_stages: int,
    *,
    memory: np.ndarray | None,
    memory_cap: float | None,
    boundary_costs: np.ndarray | None,
    inseparable: Iterable[Iterable[int]],
) -> list[int]:
    n = costs.size
    allowed = _cut_allowed(n, inseparable)
    cuts_available = int(allowed[1:n].sum())
    if cuts_available < num_stages - 1:
        raise ValueError(
            f"num_stages={num_stages} needs {num_stages - 1} cuts, but the inseparable groups leave "
            f"{cuts_available} places to cut {n} layers"
        )
    plan = _min_max_plan(costs, num_stages, cut=_cut_costs(n, boundary_costs), allowed=allowed,
                         memory=memory, memory_cap=memory_cap)
    if plan is None:
        assert memory is not None and memory_cap is not None
        # The smallest cap any plan meets: the min-max plan of the memory itself.
        tightest = _min_max_plan(memory, num_stages, cut=np.zeros(n + 1), allowed=allowed, memory=None,
                                 memory_cap=None)
        assert tightest is not None
        need = max(float(memory[i:j].sum()) for i, j in itertools.pairwise(tightest))
        raise ValueError(
            f"memory_cap={memory_cap:g} bytes cannot be met by any split into {num_stages} stages: "
            f"the smallest feasible cap is {need:g} bytes"
        )
    return plan


# ----------------------------------------------------------------------------- baselines


def _uniform(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts; the first ``n mod p`` stages take one more layer."""
    size, extra = divmod(num_layers, num_stages)
    return [k * size + min(k, extra) for k in range(num_stages + 1)]


def _greedy(costs: np.ndarray, num_stages: int) -> list[int]:
    """Cut k where the running cost is nearest k/p of the total, keeping a layer per stage."""
    n = costs.size
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    total = prefix[-1]
    bounds = [0]
    for k in range(1, num_stages):
        lo, hi = bounds[-1] + 1, n - (num_stages - k)  # leave a layer for every later stage
        target = total * k / num_stages
        bounds.append(lo + int(np.argmin(np.abs(prefix[lo : hi + 1] - target))))
    return [*bounds, n]


# ----------------------------------------------------------------------------- public API


def _method_exact(costs: np.ndarray, num_stages: int, **kw: object) -> list[int]:
    return _exact(costs, num_stages, **kw)  # type: ignore[arg-type]


def _method_uniform(costs: np.ndarray, num_stages: int, **_: object) -> list[int]:
    return _uniform(costs.size, num_stages)


def _method_parameters(costs: np.ndarray, num_stages: int, *, weights: np.ndarray, **_: object) -> list[int]:
    n = costs.size
    plan = _min_max_plan(weights, num_stages, cut=np.zeros(n + 1), allowed=np.ones(n + 1, dtype=bool),
                         memory=None, memory_cap=None)
    assert plan is not None
    return plan


def _method_greedy(costs: np.ndarray, num_stages: int, **_: object) -> list[int]:
    return _greedy(costs, num_stages)


METHODS: dict[str, Callable[..., list[int]]] = {
    "exact": _method_exact,
    "uniform": _method_uniform,
    "parameters": _method_parameters,
    "greedy": _method_greedy,
}
assert tuple(METHODS) == PARTITION_METHODS, "config.PARTITION_METHODS and METHODS must list the same names"


def partition(
    costs: Sequence[float],
    num_stages: int,
    *,
    method: str = "exact",
    weights: Sequence[float] | None = None,
    memory: Sequence[float] | None = None,
    memory_cap: float | None = None,
    boundary_costs: Sequence[float] | None = None,
    inseparable: Iterable[Iterable[int]] = (),
) -> list[int]:
    """Split ``len(costs)`` layers into ``num_stages`` contiguous stages.

    Args:
        costs: seconds per layer (forward + backward), every one > 0.
        num_stages: stages (devices) to split into, 1 ≤ num_stages ≤ len(costs).
        method: ``exact`` (default), ``uniform``, ``parameters`` or ``greedy`` (see module doc).
        weights: ``parameters`` only: parameter count (or bytes) per layer, each ≥ 0.
        memory: ``exact`` only: bytes each layer needs on its stage (parameters, gradients,
            optimizer state, activations), each ≥ 0; required with ``memory_cap``.
        memory_cap: ``exact`` only: the most bytes one stage may hold.
        boundary_costs: ``exact`` only: seconds to communicate across each possible cut
            (``len(costs) − 1`` entries; entry i is the cut after layer i), charged to both
            neighbouring stages.
        inseparable: ``exact`` only: groups of layer indices that must share a stage (every
            layer from a group's first to its last stays together).

    Returns:
        Boundary offsets ``[0, …, len(costs)]`` of length ``num_stages + 1``.

    Raises:
        ValueError: an unknown method, non-positive costs, more stages than layers (or than
            the inseparable groups allow), a memory cap no split can meet (naming the
            smallest one that can), or an option the method does not take.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: allowed are {', '.join(METHODS)}")
    c = _vector("costs", costs, length=None, positive=True)
    _check_stage_count(c.size, num_stages)
    groups = [list(group) for group in inseparable]  # once: it may be a generator
    given = {"memory": memory, "memory_cap": memory_cap, "boundary_costs": boundary_costs}
    if method != "exact":
        extra = [k for k, v in given.items() if v is not None] + (["inseparable"] if groups else [])
        if extra:
            raise ValueError(f"method={method!r} does not take {', '.join(extra)}: use method='exact'")
    if (method == "parameters") != (weights is not None):
        raise ValueError(
            "method='parameters' needs weights= (parameters per layer)" if weights is None
            else f"weights= is only used by method='parameters', not {method!r}"
        )
    if (memory is None) != (memory_cap is None):
        raise ValueError("memory= and memory_cap= go together: give both or neither")
    if memory_cap is not None and not (math.isfinite(memory_cap) and memory_cap > 0):
        raise ValueError(f"memory_cap={memory_cap!r} is invalid: need a positive number of bytes")
    kwargs: dict[str, object] = {}
    if method == "exact":
        kwargs = {
            "memory": None if memory is None else _vector("memory", memory, length=c.size, positive=False),
            "memory_cap": memory_cap,
            "boundary_costs": None if boundary_costs is None
            else _vector("boundary_costs", boundary_costs, length=c.size - 1, positive=False),
            "inseparable": groups,
        }
    elif method == "parameters":
        kwargs = {"weights": _vector("weights", weights, length=c.size, positive=False)}  # type: ignore[arg-type]
    plan = METHODS[method](c, int(num_stages), **kwargs)
    assert len(plan) == num_stages + 1 and plan[0] == 0 and plan[-1] == c.size, plan
    return plan
