"""The cost- and speed-aware :class:`BalancedBatchSampler`, and the sampler of a balance strategy.

- :class:`BalancedBatchSampler`: the shard planner (:mod:`poise.balance.sharding`): steps of
  a cost budget with length bucketing, split by predicted time using per-rank speeds that
  can be updated between steps.
- :class:`MixedBatchSampler`: plain DDP's steps (the same samples per step as
  ``DistributedSampler``), each split into per-rank ranges of similar lengths by predicted
  time: balance ``auto``'s, which changes nothing that is trained.
- :func:`make_sampler`: the batch sampler of a balance strategy (``static``: the baseline
  :class:`~poise.balance.static_schedule.StaticSchedule`; ``cost``, ``dynamic``: the balanced
  one); :func:`sampler_inputs`: the per-sample metadata and cost function it plans with, from
  what a user gives.

What every sampler shares (the batch sampler interface with ``global_batches``, batches
handed out and not yet claimed, resuming mid-epoch and on another number of ranks) is
:class:`~poise.balance.epoch_sampler.EpochSampler`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from poise.balance.costs import AttentionCost, CostFn, as_cost_fn, linear_cost
from poise.balance.epoch_sampler import EpochSampler
from poise.balance.sharding import (
    MAX_SHIFT,
    EpochPlan,
    SplitFn,
    plan_epoch,
    plan_fixed_steps,
    split_sorted,
    split_step,
    take_step,
)
from poise.balance.speeds import window_terms
from poise.balance.static_schedule import StaticSchedule

# cost(L) = L + α·L² with α ≈ 1/(6·d_model): a prior for small transformers; pass your own.
DEFAULT_ALPHA = 1e-3


class BalancedBatchSampler(EpochSampler):
    """This rank's batches under a cost- and speed-aware plan (see :mod:`poise.balance.sharding`).

    All ranks built with the same arguments together cover every index exactly once per
    epoch, and every rank gets the same number of steps. Speeds can change between steps
    (:meth:`set_speeds`); the next step is split with the new ones.

    Args:
        lengths: tokens per sample (metadata; samples are never loaded to be costed).
        rank, world_size: this rank and the number of ranks.
        batch_cost: cost budget of one step summed over all ranks, in cost units.
        cost_fn: length -> cost units (default ``L + DEFAULT_ALPHA·L²``): a function of one
            length (``lambda L: float(L)``) or of an array of them.
        speeds: relative speed per rank (default all equal); only ratios matter.
        seed: shuffling seed, shared by all ranks.
        drop_last: drop steps under half the budget (the partial steps at bucket ends).
        bucket_steps: steps' worth of samples sorted by length together.

    Example::

        sampler = BalancedBatchSampler(lengths, rank=rank, world_size=world, batch_cost=32_768)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...
    """

    # how a step is divided, and how far its boundaries may move into untaken neighbours
    split: SplitFn = staticmethod(split_step)
    max_shift: int = MAX_SHIFT

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        rank: int,
        world_size: int,
        batch_cost: float,
        cost_fn: CostFn | None = None,
        speeds: Sequence[float] | None = None,
        seed: int = 0,
        drop_last: bool = False,
        bucket_steps: int = 50,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
        self.lengths = np.asarray(lengths)
        self.rank, self.world_size = rank, world_size
        self._batch_cost = float(batch_cost)
        self.cost_fn: CostFn = as_cost_fn(cost_fn) if cost_fn is not None else AttentionCost(DEFAULT_ALPHA)
        self.seed, self.drop_last, self.bucket_steps = seed, drop_last, bucket_steps
        self.speeds = np.ones(world_size)
        self.rank_cost_fns: list[CostFn] | None = None  # each rank's own cost function (set_rank_cost_fns)
        if speeds is not None:
            self.set_speeds(speeds)
        self.epoch, self.position = 0, 0
        self.set_epoch(0)

    @property
    def batch_cost(self) -> float:
        """Cost budget of one step over all ranks (fixed: the epoch's steps were planned with it)."""
        return self._batch_cost

    @batch_cost.setter
    def batch_cost(self, value: float) -> None:
        """Refused: the epoch's steps are already planned with the budget, so a new one would
        change nothing (silently) until some later epoch."""
        raise ValueError(f"sampler.batch_cost = {value!r}: the budget is fixed when the sampler plans its epochs "
                         f"(now {self._batch_cost:g}); give it when the sampler is made (poise.Data(batch_cost=...), "
                         "batch_size= or batch_tokens=)")

    def set_epoch(self, epoch: int, remaining: np.ndarray | None = None) -> None:
        """Plan the steps of ``epoch`` (with the current cost function) and rewind to its start.

        With ``remaining``, plan only those samples (the rest of an epoch resumed on another
        number of ranks).
        """
        if not self._begin_epoch(epoch, remaining):
            return
        self.remaining = None if remaining is None else np.asarray(remaining, dtype=np.int64)
        # Steps are grouped with the cost function of the epoch's start, so a cost refit
        # mid-epoch changes how steps are split, never which samples the epoch still holds.
        self._epoch_cost_fn = self.cost_fn
        self._plan = self._plan_epoch(epoch)
        if self.drop_last:
            keep = [self.cost_fn(self.lengths[self._plan.members(j)]).sum() >= 0.5 * self.batch_cost
                    for j in self._plan.order]
            self._plan.order = self._plan.order[np.asarray(keep, dtype=bool)]
        self._splits: dict[int, list[np.ndarray]] = {}

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        """The epoch's steps: length-bucketed steps of ``batch_cost`` (see :mod:`~poise.balance.sharding`)."""
        return plan_epoch(
            self.lengths, cost_fn=self.cost_fn, batch_cost=self.batch_cost, num_ranks=self.world_size,
            seed=self.seed, epoch=epoch, bucket_steps=self.bucket_steps, subset=self.remaining,
        )

    def _like(self, world_size: int) -> BalancedBatchSampler:
        """A sampler made like this one for ``world_size`` ranks (to rebuild a saved plan)."""
        return BalancedBatchSampler(
            self.lengths, rank=0, world_size=world_size, batch_cost=self.batch_cost, cost_fn=self.cost_fn,
            seed=self.seed, drop_last=self.drop_last, bucket_steps=self.bucket_steps,
        )

    def __len__(self) -> int:
        return len(self._plan.order)

    def set_cost_fn(self, cost_fn: CostFn) -> None:
        """A new cost function: used to split the next step, and to group steps from the next epoch."""
        self.cost_fn = as_cost_fn(cost_fn)

    def set_rank_cost_fns(self, cost_fns: Sequence[CostFn] | None) -> None:
        """Each rank's own cost function for splitting the next steps (None: the shared
        ``cost_fn`` for all); speeds are then in each rank's own cost units. Steps are still
        grouped and budgeted with the shared one. Every rank must set the same ones."""
        if cost_fns is not None and len(cost_fns) != self.world_size:
            raise ValueError(f"rank cost functions: {len(cost_fns)} given for {self.world_size} ranks")
        self.rank_cost_fns = None if cost_fns is None else [as_cost_fn(f) for f in cost_fns]

    def cost_terms(self, batch_lengths: np.ndarray) -> tuple[float, float]:
        """A rank's measured step's cost terms, from which any α gives its cost (``terms[0] +
        α·terms[1]``): the padded batch's ``n·Lmax`` and ``n·Lmax²`` (what the re-planner records)."""
        terms = window_terms(batch_lengths, 0.0)
        return terms[0], terms[1]

    def set_speeds(self, speeds: Sequence[float] | np.ndarray) -> None:
        """New relative speeds per rank (every rank must set the same ones)."""
        values = np.asarray(speeds, dtype=np.float64)
        if values.shape != (self.world_size,) or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError(f"speeds must be {self.world_size} positive numbers, got {np.asarray(speeds).tolist()}")
        self.speeds = values

    def global_batches(self, step: int) -> list[np.ndarray]:
        """Every rank's sample indices for ``step`` of the current epoch.

        Steps are settled in order, each with the speeds current when it is first asked for
        (see :func:`~poise.balance.sharding.take_step`); asking again returns the same batches.
        """
        if step not in self._splits:
            if step != self._plan.taken:
                raise ValueError(f"step {step} asked before step {self._plan.taken}: steps are taken in order")
            cost = self.rank_cost_fns if self.rank_cost_fns is not None else self.cost_fn
            self._splits[step] = take_step(self._plan, self.lengths, cost, self.speeds, max_shift=self.max_shift,
                                           split=type(self).split).batches
        return self._splits[step]

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Position and speeds: enough to continue the epoch exactly where it stopped.

        ``position``: the step to resume at (default: the next one not handed out). Steps from
        there that were already handed out keep the split they were given (``settled``).
        """
        position = self.position if position is None else position
        return {
            "epoch": self.epoch,
            "position": position,
            "settled": {str(j): [b.tolist() for b in self._splits[j]] for j in range(position, self.position)},
            "speeds": self.speeds.tolist(),
            # alphas of AttentionCost; a custom cost_fn must be passed again when loading
            "alpha": getattr(self.cost_fn, "alpha", None),
            "epoch_alpha": getattr(self._epoch_cost_fn, "alpha", None),
            # each rank's own AttentionCost (set_rank_cost_fns); custom ones must be set again
            "rank_alphas": [f.alpha for f in self.rank_cost_fns] if self.rank_cost_fns is not None
            and all(isinstance(f, AttentionCost) for f in self.rank_cost_fns) else None,
            # settled step boundaries: they depend on the speeds each step was taken with
            "bounds": self._plan.bounds.tolist(),
            "taken": self._plan.taken,
            "world_size": self.world_size,
            "remaining": None if self.remaining is None else self.remaining.tolist(),
        }

    def remaining_samples(self) -> np.ndarray:
        # Steps not taken yet may still trade samples at their boundaries, but only among
        # themselves: together they hold the same samples whatever is settled later.
        rest = [self._plan.members(int(j)) for j in self._plan.order[self.position :]]
        return np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; on another number of ranks, re-plan the epoch's rest
        (with equal speeds: the saved ones belong to ranks that are gone)."""
        self._keep_epoch = None
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            saved = self._like(saved_world)
            saved.load_state_dict(state)
            self.cost_fn = saved.cost_fn
            self.set_epoch(saved.epoch, remaining=saved.remaining_samples())
            self._keep_epoch = self.epoch
            return
        if state.get("epoch_alpha") is not None:
            self.cost_fn = AttentionCost(float(state["epoch_alpha"]))
        self.set_speeds(state["speeds"])
        self.set_epoch(int(state["epoch"]), state.get("remaining"))  # regroups with the epoch's own cost function
        if state.get("alpha") is not None:
            self.set_cost_fn(AttentionCost(float(state["alpha"])))
        rank_alphas = state.get("rank_alphas")
        if rank_alphas is not None:
            if not (isinstance(rank_alphas, list) and len(rank_alphas) == self.world_size
                    and all(isinstance(a, (int, float)) and math.isfinite(a) and a >= 0 for a in rank_alphas)):
                raise ValueError(f"sampler state: rank_alphas={rank_alphas!r} must be {self.world_size} finite "
                                 "alphas >= 0, one per rank")
            self.set_rank_cost_fns([AttentionCost(float(a)) for a in rank_alphas])
        self._plan.bounds = np.asarray(state["bounds"], dtype=np.int64)
        self._plan.taken = int(state["taken"])
        self.position = int(state["position"])
        for j, batches in (state.get("settled") or {}).items():
            self._splits[int(j)] = [np.asarray(b, dtype=np.int64) for b in batches]
        self._keep_epoch = self.epoch


class MixedBatchSampler(BalancedBatchSampler):
    """Plain DDP's steps, split by cost and speed into ranges of similar lengths (balance ``auto``).

    Every step holds exactly the samples ``DistributedSampler`` gives plain DDP for that step
    (:class:`~poise.balance.static_schedule.StaticSchedule`: ``batch_size`` samples per rank,
    or ``batch_tokens`` padded tokens per rank), so the run trains what DDP trains; only who
    computes which of them changes: each step is divided into contiguous ranges of its samples
    sorted by length (:func:`~poise.balance.sharding.split_sorted`), so each rank pads little
    and the ranks' predicted times are equal under the current speeds. With the session's
    weighted loss the step's gradient is DDP's exact one (the mean over every loss term of
    the step) whatever the split.

    Args:
        lengths, rank, world_size, cost_fn, speeds, seed: as :class:`BalancedBatchSampler`.
        batch_size: samples per rank per step, as DDP's (the step: ``world_size × batch_size``).
        batch_tokens: instead, padded tokens per rank per step, as DDP's.
        batch_cost: instead, cost units per step over all ranks: steps of that budget drawn at
            random (no length bucketing), for a budget DDP has no word for.
    """

    split: SplitFn = staticmethod(split_sorted)
    max_shift = 0  # the steps are DDP's: no sample moves between them

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        rank: int,
        world_size: int,
        cost_fn: CostFn | None = None,
        speeds: Sequence[float] | None = None,
        seed: int = 0,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        batch_cost: float | None = None,
    ) -> None:
        if sum(v is not None for v in (batch_size, batch_tokens, batch_cost)) != 1:
            raise ValueError("give exactly one of batch_size, batch_tokens, batch_cost")
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        cost = as_cost_fn(cost_fn) if cost_fn is not None else AttentionCost(DEFAULT_ALPHA)
        if batch_cost is None:
            schedule = self._schedule(np.asarray(lengths), world_size, seed)  # refuses a split too small for its ranks
            batch_cost = float(np.mean([cost(np.asarray(lengths)[np.concatenate(schedule.global_batches(j))]).sum()
                                        for j in range(min(len(schedule), 64))]))
        super().__init__(lengths, rank=rank, world_size=world_size, batch_cost=batch_cost, cost_fn=cost,
                         speeds=speeds, seed=seed, bucket_steps=1)

    @property
    def _ddp_steps(self) -> bool:
        return self.batch_size is not None or self.batch_tokens is not None

    def _schedule(self, lengths: np.ndarray, world_size: int, seed: int) -> StaticSchedule:
        return StaticSchedule(lengths, rank=0, world_size=world_size, seed=seed, batch_size=self.batch_size,
                              batch_tokens=self.batch_tokens)

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        """DDP's steps of ``epoch`` (of ``remaining`` only, when resumed on another number of
        ranks); with a cost budget, steps of it in the epoch's random order (windows of one step)."""
        if not self._ddp_steps:
            return super()._plan_epoch(epoch)
        schedule = self._schedule(self.lengths, self.world_size, self.seed)
        schedule.set_epoch(epoch, self.remaining)
        return plan_fixed_steps([np.concatenate(schedule.global_batches(j)) for j in range(len(schedule))])

    def _like(self, world_size: int) -> BalancedBatchSampler:
        return MixedBatchSampler(self.lengths, rank=0, world_size=world_size, cost_fn=self.cost_fn, seed=self.seed,
                                 batch_size=self.batch_size, batch_tokens=self.batch_tokens,
                                 batch_cost=None if self._ddp_steps else self.batch_cost)

    def steps_in_epochs(self, num_epochs: int) -> int:
        """Steps of epochs ``0 .. num_epochs - 1``: DDP's, computed as its schedule does."""
        if not self._ddp_steps:
            return super().steps_in_epochs(num_epochs)
        return self._schedule(self.lengths, self.world_size, self.seed).steps_in_epochs(num_epochs)


def make_sampler(
    strategy: str,
    lengths: Sequence[int] | np.ndarray,
    *,
    rank: int,
    world_size: int,
    cost_fn: CostFn | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    batch_cost: float | None = None,
    bucket_steps: int = 50,
) -> StaticSchedule | BalancedBatchSampler:
    """The batch sampler of a balance ``strategy``: ``static`` is torch's DistributedSampler cut
    into batches; ``auto`` takes the same steps and splits each by cost / speed
    (:class:`MixedBatchSampler`); ``cost`` and ``dynamic`` plan length-bucketed steps of a cost
    budget split by cost / speed.

    Give exactly one budget: ``batch_size`` (samples per rank; for cost and dynamic, that many
    samples of average cost per rank), ``batch_tokens`` (padded tokens per rank; for cost and
    dynamic, that many tokens of the longest samples) or ``batch_cost`` (cost units per step
    over all ranks; cost and dynamic only).

    Raises:
        ValueError: for an unknown strategy or not exactly one budget.
    """
    given = [name for name, v in (("batch_size", batch_size), ("batch_tokens", batch_tokens),
                                  ("batch_cost", batch_cost)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of batch_size, batch_tokens, batch_cost (got {', '.join(given) or 'none'})")
    lengths = np.asarray(lengths)
    if strategy == "static":
        if batch_cost is not None:
            raise ValueError("balance 'static' takes batch_size or batch_tokens: batch_cost needs 'auto', 'cost' "
                             "or 'dynamic'")
        return StaticSchedule(lengths, rank=rank, world_size=world_size, seed=seed, batch_size=batch_size,
                              batch_tokens=batch_tokens)
    if strategy == "auto":
        return MixedBatchSampler(lengths, rank=rank, world_size=world_size, cost_fn=cost_fn, seed=seed,
                                 batch_size=batch_size, batch_tokens=batch_tokens, batch_cost=batch_cost)
    if strategy not in ("cost", "dynamic"):
        raise ValueError(f"balance strategy {strategy!r} is unknown: allowed are auto, static, cost, dynamic")
    cost = as_cost_fn(cost_fn) if cost_fn is not None else AttentionCost(DEFAULT_ALPHA)
    if batch_cost is None:
        if batch_tokens is not None:
            longest = float(np.max(lengths))
            batch_cost = world_size * batch_tokens / longest * float(cost(np.array([longest]))[0])
        else:
            assert batch_size is not None
            batch_cost = world_size * batch_size * float(cost(lengths).mean())
    return BalancedBatchSampler(lengths, rank=rank, world_size=world_size, batch_cost=batch_cost, cost_fn=cost,
                                seed=seed, bucket_steps=bucket_steps)


def sampler_inputs(lengths: Any, costs: Any, cost_fn: Callable[..., Any] | None, cost_model: str,
                   cost_alpha: float | None, num_samples: int | None) -> tuple[np.ndarray, CostFn]:
    """The per-sample metadata a sampler plans with, and its cost function, from what a user
    gives: ``lengths`` (cost ``cost_fn``, else by ``cost_model``: linear, or ``L + α·L²``
    with ``cost_alpha`` or the prior) or ``costs`` (used as they are); with neither, each of
    ``num_samples`` samples costs 1.

    Raises:
        ValueError: for both or none of them, or values that are not one positive number per sample.
    """
    if lengths is not None and costs is not None:
        raise ValueError("give lengths= or costs=, not both")
    if costs is not None:
        if cost_fn is not None:
            raise ValueError("costs= are used as they are: cost_fn= applies to lengths=")
        values = np.asarray(costs, dtype=np.float64)
        cost: CostFn = linear_cost()
    else:
        values = None if lengths is None else np.asarray(lengths)
        if cost_fn is not None:
            cost = as_cost_fn(cost_fn)
        elif cost_model == "linear" or values is None:
            cost = linear_cost()
        else:
            cost = AttentionCost(cost_alpha if cost_alpha is not None else DEFAULT_ALPHA)
    if values is None:
        if num_samples is None:
            raise ValueError("give lengths= (or costs=, or dataset=): the sampler needs the number of samples")
        values = np.ones(num_samples, dtype=np.int64)
    else:
        if values.ndim != 1 or len(values) == 0 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ValueError(f"{'costs' if costs is not None else 'lengths'} must be one positive number per "
                             f"sample (got shape {list(values.shape)})")
    return values, cost
