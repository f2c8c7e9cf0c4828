"""The shard planner: which samples every rank trains on at every step of an epoch.

Pure functions of (sample lengths, cost function, per-rank speeds, seed, epoch, step budget):
every rank computes the same plan with no communication (Bagua's seed+epoch idea), and the
plan is plain data that tests, benches and a simulator can inspect.

An epoch is planned in two stages:

1. **Steps** (:func:`plan_steps`). Samples are visited in a seeded random order; every
   ``bucket_steps`` steps' worth of them is sorted by length (length bucketing: a batch of
   similar lengths wastes little on padding) and cut into steps of about ``batch_cost`` cost
   units summed over ranks. Steps are then shuffled, so long and short steps interleave.
   Every sample lands in exactly one step; a step never has fewer samples than ranks (a
   short tail is merged into the step before), so no rank ever idles through a step and no
   sample is dropped at the end of an epoch.
2. **Split** (:func:`split_step`). Each step's samples are divided among ranks so that every
   rank's *predicted time* — its padded batch cost divided by its speed — is as equal as
   possible. Algorithm: greedy LPT for uniform machines (Q||Cmax; Graham 1969, Gonzalez et
   al. 1977): samples in decreasing cost, each to the rank where it would finish earliest.
   Why LPT: it is O(n·R), deterministic, within 2x of optimal in general and, because
   bucketing makes a step's samples nearly equal in cost, within one sample of optimal per
   rank here — which is what balance needs; an exact solver would buy nothing measurable.

The split reads the speeds at the time a step is taken, so re-planning with new speeds
(:mod:`poise.balance.rebalance`) changes who gets what without changing which samples
belong to which step: an epoch's coverage is fixed when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poise.balance.costs import CostFn, padded_cost


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded visiting order of one epoch (the same on every rank)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def plan_steps(
    lengths: np.ndarray,
    *,
    cost_fn: CostFn,
    batch_cost: float,
    num_ranks: int,
    seed: int,
    epoch: int,
    bucket_steps: int = 50,
) -> list[np.ndarray]:
    """Cut one epoch into steps of about ``batch_cost`` cost units each (see module doc).

    Args:
        lengths: tokens per sample (metadata), one per sample of the training split.
        cost_fn: maps lengths to cost units.
        batch_cost: cost budget of one step summed over all ranks, in cost units.
        num_ranks: ranks that will share each step (each gets at least one sample).
        bucket_steps: steps' worth of samples sorted by length together.

    Returns:
        Sample-index arrays, one per step, covering every sample exactly once.

    Raises:
        ValueError: for a non-positive budget or fewer samples than ranks.
    """
    lengths = np.asarray(lengths)
    if batch_cost <= 0:
        raise ValueError(f"batch_cost={batch_cost} must be positive (cost units per step over all ranks)")
    if len(lengths) < num_ranks:
        raise ValueError(f"{len(lengths)} samples cannot give each of {num_ranks} ranks one per step")
    order = epoch_order(len(lengths), seed, epoch)
    costs = cost_fn(lengths[order])
    # Windows of about bucket_steps steps' cost, each sorted by length (longest first).
    window_of = np.floor(np.cumsum(costs) / (batch_cost * bucket_steps)).astype(np.int64)
    steps: list[list[int]] = []
    for w in np.unique(window_of):
        members = np.flatnonzero(window_of == w)
        members = members[np.argsort(-lengths[order[members]], kind="stable")]
        current: list[int] = []
        spent = 0.0
        for m in members:
            if current and spent + costs[m] > batch_cost and len(current) >= num_ranks:
                steps.append(current)
                current, spent = [], 0.0
            current.append(int(order[m]))
            spent += float(costs[m])
        if current:
            steps.append(current)
    # A step with fewer samples than ranks (a window's tail) joins the next one, the last
    # the one before: every rank gets a sample in every step.
    full: list[list[int]] = []
    carry: list[int] = []
    for step in steps:
        carry += step
        if len(carry) >= num_ranks:
            full.append(carry)
            carry = []
    if carry:
        full[-1].extend(carry)
    shuffle = np.random.default_rng([seed, epoch, 1]).permutation(len(full))
    return [np.asarray(full[i], dtype=np.int64) for i in shuffle]


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


def split_step(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn, speeds: np.ndarray) -> StepSplit:
    """Divide one step's samples among ranks by LPT on padded cost / speed (see module doc).

    Every rank gets at least one sample when the step has at least as many samples as ranks.

    Raises:
        ValueError: if a speed is not positive and finite.
    """
    speeds = np.asarray(speeds, dtype=np.float64)
    if not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
        raise ValueError(f"speeds must be positive and finite, got {speeds.tolist()}")
    num_ranks = len(speeds)
    lengths = np.asarray(lengths)
    step_lengths = lengths[step]
    order = np.lexsort((step, -step_lengths))  # longest first; ties by index, for determinism
    item_cost = cost_fn(step_lengths[order])
    count = np.zeros(num_ranks)
    longest = np.zeros(num_ranks)  # cost of the longest sample each rank holds
    owner = np.empty(len(order), dtype=np.int64)
    for k, c in enumerate(item_cost):
        # Padded batch cost if this sample joined each rank, in that rank's time.
        finish = (count + 1) * np.maximum(longest, c) / speeds
        r = int(np.argmin(finish))
        owner[k] = r
        count[r] += 1
        longest[r] = max(longest[r], c)
    # A very slow rank may have been given nothing: hand it the cheapest sample of the
    # busiest rank, so every rank takes part in every step.
    for r in np.flatnonzero(count == 0):
        donor = int(np.argmax(count))
        if count[donor] <= 1:
            break
        k = int(np.flatnonzero(owner == donor)[-1])  # the donor's shortest sample
        owner[k], count[donor], count[r] = r, count[donor] - 1, 1
    batches = [step[order[owner == r]] for r in range(num_ranks)]
    predicted = np.array([padded_cost(cost_fn, lengths[b]) / speeds[r] for r, b in enumerate(batches)])
    return StepSplit(batches=batches, predicted_s=predicted)
