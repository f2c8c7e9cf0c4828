"""Held-out evaluation, sharded over ranks and summed with one all-reduce."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from poise.runtime.dist import DistContext
from poise.runtime.fsdp import is_fsdp_module
from poise.tasks.base import Task


@dataclass(frozen=True)
class EvalResult:
    """Held-out figures over the whole evaluated set (all ranks together).

    Attributes:
        loss: bits per byte for code-lm, nats per sample for digits (see ``unit``).
        accuracy: share of targets predicted exactly (next byte, or digit class).
        count: targets evaluated (bytes or images).
        unit: unit of ``loss``.
    """

    loss: float
    accuracy: float
    count: int
    unit: str


def eval_indices(num_samples: int, max_samples: int) -> np.ndarray:
    """A fixed subset of the held-out split (seed 0, independent of the run's seed)."""
    order = np.random.default_rng(0).permutation(num_samples)
    return order if max_samples == 0 else order[:max_samples]


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, ctx: DistContext, *, max_samples: int, batch_size: int) -> EvalResult:
    """Evaluate ``model`` (the bare module, not the DDP wrapper) on the held-out split.

    Each rank takes every ``world_size``-th sample of the fixed subset; sums are added
    across ranks, so the result does not depend on the number of ranks. A model sharded with
    FSDP2 gathers each block's parameters from every rank in its forward, so there every rank
    runs as many forwards as the rank with the most samples: one with fewer runs the rest on
    one sample and counts nothing of them.
    """
    subset = eval_indices(len(task.eval_set), max_samples)
    mine = subset[ctx.rank :: ctx.world_size]
    forwards = math.ceil(len(mine) / batch_size)
    if is_fsdp_module(model):
        forwards = math.ceil(math.ceil(len(subset) / ctx.world_size) / batch_size)  # rank 0's: the most
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    was_training = model.training
    model.eval()
    for start in range(0, forwards * batch_size, batch_size):
        if start >= len(mine):  # lockstep with the other ranks' forwards: nothing counted
            task.eval_sums(model, task.collate([task.eval_set[int(subset[0])]]).to(ctx.device))
            continue
        batch = task.collate([task.eval_set[int(i)] for i in mine[start : start + batch_size]])
        part = task.eval_sums(model, batch.to(ctx.device))
        sums += torch.tensor([part.loss_sum, part.correct, part.count], dtype=torch.float64, device=ctx.device)
    model.train(was_training)
    if ctx.world_size > 1:
        dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    count = max(count, 1.0)
    return EvalResult(
        loss=task.loss_in_unit(loss_sum / count), accuracy=correct / count, count=int(count), unit=task.loss_unit
    )
