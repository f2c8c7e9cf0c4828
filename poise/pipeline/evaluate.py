"""Held-out evaluation through the pipeline: forward only, each replica on its share of each
batch, the sums added over the replicas.

The samples are those ``poise train`` evaluates (:func:`poise.train.evaluate.eval_indices`:
a fixed subset of the held-out split, ``task.eval_max_samples``), so an eval loss here is the
one ``poise train`` would report for the same weights, and the two compare at equal loss
(``poise bench parallel``). Batches have the training step's shape (the stages run no other):
``train.batch_size`` rows, the last one filled up with rows that count nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from poise.pipeline.batches import eval_batch
from poise.pipeline.stage import StageRunner
from poise.tasks.base import IGNORE_INDEX, Task


def evaluate(runner: StageRunner, task: Task, subset: np.ndarray, *, batch_size: int, length: int,
             shares: Sequence[np.ndarray], dp_rank: int) -> tuple[float, int]:
    """``(summed cross-entropy in nats, real targets)`` over ``subset``, on every rank.

    Every rank of the world takes part: each replica's stages run its share of each batch (the
    ``shares`` of training), its last stage sums the loss (a weight of its target count turns
    :class:`~poise.pipeline.stage.TokenLoss`'s mean back into the sum), and one all-reduce over
    the world adds the last stages' sums.
    """
    total = torch.zeros(2, dtype=torch.float64)
    share = torch.from_numpy(np.asarray(shares[dp_rank]))
    for start in range(0, len(subset), batch_size):
        batch = eval_batch(task, subset[start:start + batch_size], batch_size, length)
        inputs, targets = batch.inputs[share], batch.targets[share]
        count = int((targets != IGNORE_INDEX).sum())
        loss = runner.evaluate(inputs if runner.is_first else None, targets if runner.is_last else None,
                               float(count))
        if loss is not None:
            total += torch.tensor([loss, count], dtype=torch.float64)
    device = next(runner.module.parameters()).device
    total = total.to(device)
    dist.all_reduce(total)
    return float(total[0]), int(total[1])
