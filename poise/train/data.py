"""From the config to a built-in task and this rank's batch sampler, for ``poise train``.

The strategies of ``--balance`` (see :func:`poise.balance.make_sampler`):

- ``auto`` (the default): :class:`~poise.balance.sampler.MixedBatchSampler`: plain DDP's steps,
  each split by cost and by the speeds the session measures (``poise/decide/``);
- ``static``: :class:`~poise.balance.static_schedule.StaticSchedule` (torch's DistributedSampler);
- ``cost``: :class:`~poise.balance.sampler.BalancedBatchSampler` with equal speeds: steps of a
  cost budget with length bucketing, split by padded cost;
- ``dynamic``: the same sampler, re-planned from measured speeds by the session.

With ``task.packed``, documents packed into rows (:class:`~poise.balance.packed_sampler.PackedBatchSampler`):
``static`` fills rows in order, equal rows per rank; the others split each step's pieces by
cost and speed (re-planned under ``auto`` and ``dynamic``).

What is task-specific lives here: the cost model's α (the task's prior unless the config
sets one) and the step budget of ``--batch-tokens`` (full-length samples of the task's
``max_seq_len``). Everything after this is the public :class:`poise.Session`, as in a
user's own script.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from poise.balance.costs import AttentionCost
from poise.balance.packed_sampler import make_packed_sampler
from poise.balance.sampler import BalancedBatchSampler, make_sampler
from poise.balance.static_schedule import StaticSchedule
from poise.config import RunConfig
from poise.runtime.dist import DistContext
from poise.tasks.base import Task
from poise.tasks.registry import build_task


def build_task_once_per_node(config: RunConfig, ctx: DistContext) -> Task:
    """The configured task. Local rank 0 builds first (it may index and cache the corpus); the
    others then load the cache instead of all parsing the same files at once."""
    if ctx.local_rank != 0:
        dist.barrier()
    task = build_task(config)
    if ctx.local_rank == 0:
        dist.barrier()
    return task


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


def build_sampler(config: RunConfig, task: Task, rank: int, world_size: int) -> StaticSchedule | BalancedBatchSampler:
    """This rank's sampler for ``config.balance.strategy`` over the task's training split."""
    b, t = config.balance, config.train
    batch_size = t.batch_size or (None if t.batch_tokens else task.default_batch_size)
    if task.row_tokens is not None:  # packed rows: batch_size counts rows per rank
        return make_packed_sampler(b.strategy, task.train_lengths, rank=rank, world_size=world_size,
                                   row_tokens=task.row_tokens, batch_size=batch_size, batch_tokens=t.batch_tokens,
                                   cost_fn=AttentionCost(cost_alpha(config, task)), seed=t.seed)
    if b.strategy == "static":
        return make_sampler("static", task.train_lengths, rank=rank, world_size=world_size, seed=t.seed,
                            batch_size=batch_size, batch_tokens=t.batch_tokens)
    cost = AttentionCost(cost_alpha(config, task))
    if b.strategy == "auto":  # plain DDP's steps (its budget), split by cost and speed
        return make_sampler("auto", task.train_lengths, rank=rank, world_size=world_size, cost_fn=cost, seed=t.seed,
                            batch_size=batch_size, batch_tokens=t.batch_tokens)
    return make_sampler(b.strategy, task.train_lengths, rank=rank, world_size=world_size, cost_fn=cost, seed=t.seed,
                        batch_cost=step_budget(config, task, world_size, cost), bucket_steps=b.bucket_steps)
