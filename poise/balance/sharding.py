"""The shard planner: which samples every rank trains on at every step of an epoch.

Pure functions of (sample lengths, cost function, per-rank speeds, seed, epoch, step budget):
every rank computes the same plan with no communication (Bagua's seed+epoch idea), and the
plan is plain data that tests, benches and a simulator can inspect.

An epoch is planned in three stages:

1. **Steps** (:func:`plan_epoch`). Samples are visited in a seeded random order; every
   ``bucket_steps`` steps' worth of them (a window) is sorted by length (length bucketing: a
   batch of similar lengths wastes little on padding) and cut into steps of about
   ``batch_cost`` cost units summed over ranks. A step is a contiguous range of this
   length-sorted *stream*. Steps are visited in shuffled order, so long and short steps
   interleave. Every sample lands in exactly one step; a step never has fewer samples than
   ranks, so no rank idles through a step and no sample is dropped at the end of an epoch.
2. **Boundaries** (:func:`take_step`). When a step is taken, its samples are nearly equal in
   cost, so its split can only be as fine as one sample: 15 equal samples over 2 equal ranks
   is 8 against 7, a balance of 0.875. So the step may move its boundaries by up to
   ``max_shift`` samples into a neighbouring step of the same window that has not been taken
   yet (neighbours in the stream have nearly the same length, so padding is unchanged), and
   keeps the boundaries that best balance the step *and* the neighbours it changes, under
   the *current* speeds: scored on the step alone, a step of long samples would take what
   it needs and leave a neighbour too few samples to be split well (2 at a speed ratio of
   2.25: a balance of 0.44). Coverage stays exact: samples only move between steps not yet
   taken.
3. **Split** (:func:`split_step`). The step's samples are divided among ranks so that every
   rank's *predicted time* — its padded batch cost divided by its speed — is as equal as
   possible; each rank may have its own cost function (a device whose time grows faster
   with length). Algorithm: greedy LPT for uniform machines (Q||Cmax; Graham 1969, Gonzalez
   et al. 1977): samples in decreasing cost, each to the rank where it would finish earliest.
   Why LPT: it is O(n·R), deterministic, within 2x of optimal in general and, because
   bucketing makes a step's samples nearly equal in cost, within one sample of optimal per
   rank here; stage 2 removes most of that last sample's error.

Steps are taken in order and read the speeds of that moment, so re-planning with new speeds
(:mod:`poise.balance.rebalance`) changes who gets what in later steps.

**Mixed steps** (balance ``auto``). Length bucketing changes what a step holds: a step of
short samples and a step of long ones pull the model different ways, and a run needs more
tokens to reach the same loss (the loss oscillation reported for Hugging Face's
``group_by_length``). :func:`plan_fixed_steps` takes the steps as given instead (plain DDP's:
``DistributedSampler``'s shuffled draw, the same samples per step), each its own window so no
boundary moves, and :func:`split_sorted` divides a step into contiguous ranges of its samples
sorted by length, one range per rank, cut so that the predicted times are as equal as
possible. Each rank's batch then holds similar lengths (padding is per rank: only there does
homogeneity matter), the step is still a random mix of the whole length distribution, and
the weighted loss makes its gradient the same whatever the split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from poise.balance.costs import CostFn, padded_cost
from poise.balance.metrics import balance

# Samples each boundary of a step may move (stage 2). A step of long samples holds few of
# them (6 of 1,024 tokens at code-lm's defaults); a speed ratio of 2.24 needs 9 against 4, so
# 2 was too few to reach it; 4 costs about 5 ms per step taken (R = 2, code-lm at batch 16).
MAX_SHIFT = 4


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded visiting order of one epoch (the same on every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


@dataclass
class EpochPlan:
    """One epoch's steps as ranges of a length-bucketed stream of sample indices.

    Attributes:
        stream: every sample index once: the epoch's random order, each window sorted by
            length (longest first).
        bounds: step ``j`` is ``stream[bounds[j]:bounds[j + 1]]`` (``num_steps + 1`` offsets).
        window: the bucketing window of each step (boundaries never cross windows).
        order: the shuffled order in which steps are taken.
        taken: how many steps of ``order`` have been taken (their bounds are final).
    """

    stream: np.ndarray
    bounds: np.ndarray
    window: np.ndarray
    order: np.ndarray
    taken: int = 0

    @property
    def num_steps(self) -> int:
        return len(self.order)

    def members(self, j: int) -> np.ndarray:
        """Sample indices of step ``j`` (by step id, not visiting position)."""
        return self.stream[self.bounds[j] : self.bounds[j + 1]]

    def steps(self) -> list[np.ndarray]:
        """Every step's samples, in visiting order, with the current boundaries."""
        return [self.members(int(j)) for j in self.order]


def plan_epoch(
    lengths: np.ndarray,
    *,
    cost_fn: CostFn,
    batch_cost: float,
    num_ranks: int,
    seed: int,
    epoch: int,
    bucket_steps: int = 50,
    subset: np.ndarray | None = None,
) -> EpochPlan:
    """Cut one epoch into steps of about ``batch_cost`` cost units each (see module doc).

    Args:
        lengths: tokens per sample (metadata), one per sample of the training split.
        cost_fn: maps lengths to cost units.
        batch_cost: cost budget of one step summed over all ranks, in cost units.
        num_ranks: ranks that will share each step (each gets at least one sample).
        bucket_steps: steps' worth of samples sorted by length together.
        subset: plan only these sample indices (the rest of an epoch resumed on another
            number of ranks), still in the epoch's seeded order; None plans every sample.

    Raises:
        ValueError: for a non-positive budget or fewer samples than ranks.
    """
    lengths = np.asarray(lengths)
    if batch_cost <= 0:
        raise ValueError(f"batch_cost={batch_cost} must be positive (cost units per step over all ranks)")
    order = epoch_order(len(lengths), seed, epoch)
    if subset is not None:
        order = order[np.isin(order, subset)]
    if len(order) < num_ranks:
        raise ValueError(f"{len(order)} samples cannot give each of {num_ranks} ranks one per step")
    window_of = np.floor(np.cumsum(cost_fn(lengths[order])) / (batch_cost * bucket_steps)).astype(np.int64)
    stream_parts, bounds, windows = [], [0], []
    offset = 0
    for w in np.unique(window_of):
        members = order[window_of == w]
        members = members[np.argsort(-lengths[members], kind="stable")]
        costs = cost_fn(lengths[members])
        cuts, spent, start = [], 0.0, 0
        for k, c in enumerate(costs):
            if k > start and spent + c > batch_cost and k - start >= num_ranks:
                cuts.append(k)
                start, spent = k, 0.0
            spent += float(c)
        for cut in cuts:
            bounds.append(offset + cut)
            windows.append(int(w))
        offset += len(members)
        bounds.append(offset)
        windows.append(int(w))
        stream_parts.append(members)
    # A step with fewer samples than ranks (a window's tail) joins its neighbour.
    j = 0
    while j < len(windows) and len(windows) > 1:
        if bounds[j + 1] - bounds[j] >= num_ranks:
            j += 1
            continue
        merge_at = j + 1 if j + 1 < len(windows) else j  # the bound between it and a neighbour
        del bounds[merge_at]
        del windows[merge_at]
        j = max(0, j - 1)
    stream = np.concatenate(stream_parts)
    num_steps = len(bounds) - 1
    visit = np.random.default_rng([seed, epoch, 1]).permutation(num_steps)
    return EpochPlan(stream, np.asarray(bounds, dtype=np.int64), np.asarray(windows), visit)


def plan_fixed_steps(steps: Sequence[np.ndarray]) -> EpochPlan:
    """An epoch whose steps are given (each an array of sample indices), visited in the given
    order, each its own window so :func:`take_step` never moves a boundary: the steps hold
    exactly these samples whatever the speeds (see "Mixed steps" in the module doc).

    Raises:
        ValueError: when there is no step, or a step is empty.
    """
    if not steps or any(len(s) == 0 for s in steps):
        raise ValueError("fixed steps: give at least one step, each with at least one sample")
    sizes = np.array([len(s) for s in steps], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    stream = np.concatenate([np.asarray(s, dtype=np.int64) for s in steps])
    return EpochPlan(stream, bounds, np.arange(len(steps)), np.arange(len(steps)))


def take_step(
    plan: EpochPlan,
    lengths: np.ndarray,
    cost_fn: CostFn | Sequence[CostFn],
    speeds: np.ndarray,
    *,
    max_shift: int = MAX_SHIFT,
    split: SplitFn | None = None,
) -> StepSplit:
    """Take the next step of ``plan``: settle its boundaries for the best split, and split it.

    Tries moving each boundary shared with a not-yet-taken step of the same window by up to
    ``max_shift`` samples (both steps keep at least one sample per rank) and keeps the
    candidate with the best predicted balance under ``speeds`` (ties: the smallest move).
    ``cost_fn``: one cost function, or one per rank (see :func:`split_step`); ``split``: how a
    step is divided (default :func:`split_step`). Mutates ``plan`` (bounds, taken).
    O(max_shift² · n · R) for a step of n samples over R ranks.
    """
    split = split or split_step
    num_ranks = len(speeds)
    j = int(plan.order[plan.taken])
    pending = set(plan.order[plan.taken + 1 :].tolist())  # not taken (nor dropped): may still change
    b = plan.bounds

    def movable(neighbour: int) -> bool:
        return neighbour in pending and plan.window[neighbour] == plan.window[j]

    left = range(-max_shift, max_shift + 1) if movable(j - 1) else range(1)
    right = range(-max_shift, max_shift + 1) if movable(j + 1) else range(1)

    def neighbour_balance(lo: int, hi: int) -> float:
        """A neighbour's balance were it split as it stands after the move (0: too small)."""
        if hi - lo < num_ranks:
            return 0.0
        return balance(split(plan.stream[lo:hi], lengths, cost_fn, speeds).predicted_s)

    # Moving a boundary changes a neighbour too: the move is scored on both, so that a step
    # does not balance itself by leaving its neighbour a handful of samples that cannot be.
    left_after = {dl: neighbour_balance(b[j - 1], b[j] + dl) if dl or movable(j - 1) else 0.0 for dl in left}
    right_after = {dr: neighbour_balance(b[j + 1] + dr, b[j + 2]) if dr or movable(j + 1) else 0.0 for dr in right}
    scored: dict[tuple[int, int], tuple[tuple[float, int, int, int], StepSplit]] = {}

    def score(dl: int, dr: int) -> tuple[float, int, int, int]:
        if (dl, dr) not in scored:
            lo, hi = b[j] + dl, b[j + 1] + dr
            if hi - lo < num_ranks or (dl and left_after[dl] == 0.0) or (dr and right_after[dr] == 0.0):
                return (math.inf, 0, dl, dr)  # every step keeps one sample per rank
            divided = split(plan.stream[lo:hi], lengths, cost_fn, speeds)
            total = balance(divided.predicted_s) + left_after[dl] + right_after[dr]
            scored[dl, dr] = ((-total, abs(dl) + abs(dr), dl, dr), divided)
        return scored[dl, dr][0]

    best: tuple[float, int, int, int] = (math.inf, 0, 0, 0)
    for dl in left:
        for dr in right:
            best = min(best, score(dl, dr))
    _, _, dl, dr = best
    best_split = scored[dl, dr][1]  # (0, 0) is always a candidate
    b[j] += dl
    b[j + 1] += dr
    plan.taken += 1
    return best_split


@dataclass(frozen=True)
class StepSplit:
    """One step divided among ranks.

    Attributes:
        batches: sample indices per rank.
        predicted_s: predicted time per rank, padded cost / speed (seconds when speeds are
            measured in cost units per second; relative units otherwise).
    """

    batches: list[np.ndarray]
    predicted_s: np.ndarray


# (a step's sample indices, every sample's length, the cost function(s), per-rank speeds) -> the split
SplitFn = Callable[[np.ndarray, np.ndarray, "CostFn | Sequence[CostFn]", np.ndarray], StepSplit]


def checked_speeds(speeds: np.ndarray, cost_fn: CostFn | Sequence[CostFn]) -> tuple[np.ndarray, list[CostFn]]:
    """Speeds as an array (each positive and finite) and one cost function per rank: what every
    planner of a step (this module's and :mod:`poise.balance.packing`'s) starts from.

    Raises:
        ValueError: if a speed is not positive and finite.
    """
    speeds = np.asarray(speeds, dtype=np.float64)
    if not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
        raise ValueError(f"speeds must be positive and finite, got {speeds.tolist()}")
    return speeds, list(cost_fn) if isinstance(cost_fn, (list, tuple)) else [cost_fn] * len(speeds)


def _longest_first(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn | Sequence[CostFn], speeds: np.ndarray
                   ) -> tuple[np.ndarray, list[CostFn], np.ndarray, np.ndarray]:
    """What every split starts from: :func:`checked_speeds`, the lengths as an array, and the
    order of the step's samples, longest first (ties by index, for determinism)."""
    speeds, fns = checked_speeds(speeds, cost_fn)
    lengths = np.asarray(lengths)
    return speeds, fns, lengths, np.lexsort((step, -lengths[step]))


def split_step(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn | Sequence[CostFn],
               speeds: np.ndarray) -> StepSplit:
    """Divide one step's samples among ranks by LPT on padded cost / speed (see module doc).

    Every rank gets at least one sample when the step has at least as many samples as ranks.
    ``cost_fn`` may be one per rank, each rank's ``speeds`` entry then in its own cost units:
    devices differ in how their time grows with length (a rank throttled by a CPU quota, or
    a GPU without fused attention, loses more on long samples than on short ones), and one
    speed per rank would give the slow rank too much of the long steps and too little of
    the short ones.

    Raises:
        ValueError: if a speed is not positive and finite.
    """
    speeds, fns, lengths, order = _longest_first(step, lengths, cost_fn, speeds)
    num_ranks = len(speeds)
    sorted_lengths = lengths[step][order]
    # every sample's cost in every rank's cost units: [ranks, samples]
    item_cost = np.stack([np.asarray(f(sorted_lengths), dtype=np.float64) for f in fns])
    # Plain Python floats: this loop runs for every candidate boundary of every step taken,
    # and numpy's per-call overhead on arrays of R elements would dominate it.
    rate = [1.0 / float(v) for v in speeds]
    count = [0] * num_ranks
    longest = [0.0] * num_ranks  # cost, in its own units, of the longest sample each rank holds
    owner = np.empty(len(order), dtype=np.int64)
    for k, column in enumerate(item_cost.T.tolist()):
        # Padded batch cost if this sample joined each rank, in that rank's time.
        finish = [(count[r] + 1) * max(longest[r], column[r]) * rate[r] for r in range(num_ranks)]
        r = finish.index(min(finish))
        owner[k] = r
        count[r] += 1
        longest[r] = max(longest[r], column[r])
    count = np.asarray(count)
    # A very slow rank may have been given nothing: hand it the cheapest sample of the
    # busiest rank, so every rank takes part in every step.
    for r in np.flatnonzero(count == 0):
        donor = int(np.argmax(count))
        if count[donor] <= 1:
            break
        k = int(np.flatnonzero(owner == donor)[-1])  # the donor's shortest sample
        owner[k], count[donor], count[r] = r, count[donor] - 1, 1
    batches = [step[order[owner == r]] for r in range(num_ranks)]
    predicted = np.array([padded_cost(fns[r], lengths[b]) / speeds[r] for r, b in enumerate(batches)])
    return StepSplit(batches=batches, predicted_s=predicted)


def split_sorted(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn | Sequence[CostFn],
                 speeds: np.ndarray) -> StepSplit:
    """Divide one step into contiguous ranges of its samples sorted by length, one range per
    rank, with the most equal predicted times (padded cost / speed) such ranges allow.

    Why contiguous: padding is per rank, so a rank's batch of similar lengths pads little even
    when the step is a random draw (LPT, :func:`split_step`, deals a random step's lengths
    round the ranks and keeps its padding). A range starting at the ``p``-th longest sample
    and holding ``k`` of them costs ``k·cost(L_p)`` (its longest sets the padding), so for a
    time bound ``T`` each rank in turn takes the most samples that fit: a greedy check in
    O(R), and the least feasible ``T`` is found by bisection. The order in which ranks take
    the ranges matters (a fast rank is best given the long samples); the fastest-first and
    slowest-first orders and the ranks' own order are tried, and the best kept (ties: the
    ranks' own). Every rank gets at least one sample when the step has as many as ranks.
    O(n log n + R·log(1/ε)) per step; deterministic.

    Raises:
        ValueError: if a speed is not positive and finite.
    """
    step = np.asarray(step, dtype=np.int64)
    speeds, fns, lengths, order = _longest_first(step, lengths, cost_fn, speeds)
    num_ranks = len(speeds)
    ranked = step[order]
    n = len(ranked)
    # seconds per sample of a range that starts at each position, per rank: [ranks, n]
    unit = np.stack([np.asarray(f(lengths[ranked]), dtype=np.float64) for f in fns]) / speeds[:, None]

    def cut(rank_order: Sequence[int], bound: float) -> list[int] | None:
        """Samples each rank (in ``rank_order``) takes under ``bound`` seconds, or None when
        they cannot all be taken; every rank after the current one keeps at least one."""
        counts, pos = [0] * num_ranks, 0
        for i, r in enumerate(rank_order):
            room = n - pos
            if room <= 0:
                continue
            most = room - (num_ranks - i - 1) if n >= num_ranks else room
            per = float(unit[r, pos])
            fits = math.floor(bound / per * (1 + 1e-12)) if per > 0 else most
            counts[r] = max(1, min(most, fits))
            pos += counts[r]
        return counts if pos >= n else None

    def slowest_s(rank_order: Sequence[int], counts: list[int]) -> float:
        pos, slowest = 0, 0.0
        for r in rank_order:
            if counts[r]:
                slowest = max(slowest, counts[r] * float(unit[r, pos]))
                pos += counts[r]
        return slowest

    def best_for(rank_order: Sequence[int]) -> tuple[float, list[int]]:
        low, high = 0.0, float(unit[:, 0].max()) * n  # any order fits this bound
        found = cut(rank_order, high)
        assert found is not None
        for _ in range(60):
            mid = 0.5 * (low + high)
            counts = cut(rank_order, mid)
            if counts is None:
                low = mid
            else:
                high, found = mid, counts
            if high - low <= 1e-9 * high:
                break
        return slowest_s(rank_order, found), found

    candidates = [list(range(num_ranks)), [int(r) for r in np.argsort(-speeds, kind="stable")],
                  [int(r) for r in np.argsort(speeds, kind="stable")]]
    best: tuple[float, int, list[int], list[int]] | None = None
    for k, rank_order in enumerate(candidates):
        seconds, counts = best_for(rank_order)
        if best is None or seconds < best[0] * (1 - 1e-9):
            best = (seconds, k, rank_order, counts)
    assert best is not None
    _, _, rank_order, counts = best
    batches: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_ranks
    pos = 0
    for r in rank_order:
        batches[r] = ranked[pos:pos + counts[r]]
        pos += counts[r]
    predicted = np.array([padded_cost(fns[r], lengths[b]) / speeds[r] if len(b) else 0.0
                          for r, b in enumerate(batches)])
    return StepSplit(batches=batches, predicted_s=predicted)
