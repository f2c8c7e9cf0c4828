"""From the config to this rank's batches: the schedule, the re-planner and the step iterator.

The three strategies of ``--balance``:

- ``static``: :class:`~poise.balance.sampler.StaticSchedule` (torch's DistributedSampler);
- ``cost``: :class:`~poise.balance.sampler.BalancedBatchSampler` with equal speeds: steps of a
  cost budget with length bucketing, split by padded cost;
- ``dynamic``: the same sampler plus a :class:`~poise.balance.rebalance.DynamicPartitioner`
  that re-measures speeds and re-splits.

Whatever the strategy, every rank knows every rank's batch for a step, so it knows its share
of the step's loss terms. Scaling the local mean loss by ``world_size × share`` makes DDP's
plain average equal the gradient of the whole step's batch, however unequal the batches
are (:func:`loss_scale`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.balance.costs import AttentionCost
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.sampler import BalancedBatchSampler, StaticSchedule
from poise.config import RunConfig
from poise.runtime.dist import DistContext
from poise.tasks.base import Task

Schedule = StaticSchedule | BalancedBatchSampler


def cost_alpha(config: RunConfig, task: Task) -> float:
    """α of the per-sample cost L + α·L² for this run (0 = linear)."""
    b = config.balance
    if b.cost_model == "linear":
        return 0.0
    if b.cost_alpha is not None:
        return b.cost_alpha
    if b.cost_model == "attention" and task.cost_alpha == 0.0:
        raise ValueError(f"balance.cost_model='attention' needs balance.cost_alpha for task {task.name!r}")
    return task.cost_alpha


def step_budget(config: RunConfig, task: Task, world_size: int, cost: AttentionCost) -> float:
    """Cost budget of one step over all ranks, in cost units.

    ``--batch-tokens T``: the cost of ``T / max_seq_len`` full-length samples per rank (T tokens
    per rank for a linear cost). ``--batch-size B``: B samples of average cost per rank.
    """
    if config.train.batch_tokens is not None:
        full = float(cost(np.array([config.task.max_seq_len]))[0])
        return world_size * config.train.batch_tokens / config.task.max_seq_len * full
    batch_size = config.train.batch_size or task.default_batch_size
    return world_size * batch_size * float(cost(task.train_lengths).mean())


@dataclass
class DataPlan:
    """This rank's schedule, and the re-planner when the strategy is dynamic."""

    schedule: Schedule
    partitioner: DynamicPartitioner | None
    num_steps: int | None
    num_epochs: int | None

    def steps(self, done: int = 0) -> Iterator[list[np.ndarray]]:
        """Every rank's batches, step after step, cycling epochs as needed.

        Starts at the schedule's current epoch and position, ``done`` steps into the run: a
        resumed run (:meth:`load_state_dict`) continues exactly where the saved one stopped.
        """
        epoch = self.schedule.epoch
        while self.num_epochs is None or epoch < self.num_epochs:
            if epoch != self.schedule.epoch:
                self.schedule.set_epoch(epoch)
            for i in range(self.schedule.position, len(self.schedule)):
                if self.num_steps is not None and done >= self.num_steps:
                    return
                batches = self.schedule.global_batches(i)
                self.schedule.position = i + 1
                yield batches
                done += 1
            epoch += 1

    def state_dict(self) -> dict[str, Any]:
        """The schedule's position (and plan state) and the re-planner's measurements."""
        return {"schedule": self.schedule.state_dict(),
                "partitioner": self.partitioner.state_dict() if self.partitioner else None}

    def load_state_dict(self, state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        """Continue the saved position. ``rank_state`` is this rank's saved re-planner window
        (None when the run resumes on another number of ranks: the shares and windows belonged
        to ranks that are gone, so the re-planner starts over from equal shares)."""
        same_world = int(state["schedule"].get("world_size", self.schedule.world_size)) == self.schedule.world_size
        self.schedule.load_state_dict(state["schedule"])
        if self.partitioner is not None and state.get("partitioner") and same_world and rank_state is not None:
            self.partitioner.load_state_dict({**state["partitioner"], "window": rank_state["window"]})

    def total_steps(self) -> int:
        """Steps :meth:`steps` will yield (for epochs: planned now, before any re-fit of costs)."""
        if self.num_steps is not None:
            return self.num_steps
        assert self.num_epochs is not None
        total = 0
        for epoch in range(self.num_epochs):
            self.schedule.set_epoch(epoch)
            total += len(self.schedule)
        self.schedule.set_epoch(0)
        return total


def build_data_plan(config: RunConfig, task: Task, ctx: DistContext) -> DataPlan:
    """The schedule (and re-planner) for ``config.balance.strategy`` on this rank."""
    b, t = config.balance, config.train
    if b.strategy == "static":
        batch_size = t.batch_size or (None if t.batch_tokens else task.default_batch_size)
        schedule: Schedule = StaticSchedule(
            task.train_lengths, rank=ctx.rank, world_size=ctx.world_size, seed=t.seed,
            batch_size=batch_size, batch_tokens=t.batch_tokens,
        )
    else:
        cost = AttentionCost(cost_alpha(config, task))
        schedule = BalancedBatchSampler(
            task.train_lengths, rank=ctx.rank, world_size=ctx.world_size,
            batch_cost=step_budget(config, task, ctx.world_size, cost), cost_fn=cost, seed=t.seed,
            bucket_steps=b.bucket_steps,
        )
    partitioner = None
    if b.strategy == "dynamic":
        assert isinstance(schedule, BalancedBatchSampler)
        partitioner = DynamicPartitioner(
            schedule, cold_start_steps=b.cold_start_steps, window_steps=b.window_steps,
            replan_every_steps=b.replan_every_steps, max_share_change=b.max_share_change,
            fit_alpha=b.fit_alpha, device=ctx.device,
        )
    # The schedule's steps are micro-batches: an optimizer step takes accum_steps of them.
    micro_steps = None if config.total_steps is None else config.total_steps * t.accum_steps
    return DataPlan(schedule, partitioner, micro_steps, t.epochs)


def loss_scale(batches: list[np.ndarray], rank: int, targets: np.ndarray) -> float:
    """``world_size × (this rank's loss terms / all ranks' loss terms)`` for one step.

    With each rank's loss the mean over its own terms, scaling it by this factor before
    DDP averages gradients (÷ world_size) yields Σ_r share_r · ∇loss_r: the gradient of the
    mean loss over the whole step's batch.
    """
    counts = np.array([targets[b].sum() for b in batches], dtype=np.float64)
    total = counts.sum()
    return float(len(batches) * counts[rank] / total) if total > 0 else 1.0
