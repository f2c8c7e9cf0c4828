"""The pipeline's batches: fixed shapes, the same on every rank.

Every batch is padded to the pipeline's length (``task.max_seq_len − 1``): torch's pipelining
sets each stage up for the shapes of the first step. Padding is causal-masked and its targets
ignored, so a padded batch's loss is the unpadded one's. Training batches are a seeded
permutation per epoch (:class:`FixedLengthBatches`); evaluation batches
(:func:`eval_batch`) take the held-out subset ``poise train`` evaluates, in order.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from poise.tasks.base import IGNORE_INDEX, Batch, Task


class FixedLengthBatches:
    """The same batches on every rank: a seeded permutation per epoch, padded to ``length``."""

    def __init__(self, task: Task, batch_size: int, length: int, seed: int) -> None:
        self.task = task
        self.batch_size = batch_size
        self.length = length
        self.seed = seed
        self.num_samples = len(task.train_lengths)
        if batch_size > self.num_samples:
            raise ValueError(f"train.batch_size={batch_size} exceeds the {self.num_samples} training samples")
        self.per_epoch = self.num_samples // batch_size

    def batch(self, step: int) -> Batch:
        epoch, index = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
        return pad_batch(self.task.collate([self.task.train_set[int(i)] for i in chosen]), self.length)


def first_micro_batch(batches: FixedLengthBatches, num_micro_batches: int, samples: int | None = None) -> Batch:
    """The first micro-batch of step 0 (torch's pipelining cuts a batch into chunks of ⌈B / m⌉
    rows; ``samples``: B, the samples one pipeline runs per step, default the whole batch)."""
    first = batches.batch(0)
    rows = math.ceil((samples or batches.batch_size) / num_micro_batches)
    return Batch(first.inputs[:rows], first.targets[:rows], rows, 0, 0)


def pad_batch(batch: Batch, length: int) -> Batch:
    """Right-pad inputs (byte 0) and targets (ignored) to ``length`` tokens."""
    extra = length - batch.inputs.shape[1]
    if extra < 0:
        raise ValueError(f"batch of {batch.inputs.shape[1]} tokens is longer than the pipeline length {length}")
    rows = batch.inputs.shape[0]
    return Batch(
        inputs=torch.cat([batch.inputs, batch.inputs.new_zeros(rows, extra)], dim=1),
        targets=torch.cat([batch.targets, batch.targets.new_full((rows, extra), IGNORE_INDEX)], dim=1),
        num_samples=batch.num_samples,
        num_tokens=batch.num_tokens,
        num_padded_tokens=rows * (length + 1),
    )


def eval_batch(task: Task, indices: np.ndarray, batch_size: int, length: int) -> Batch:
    """The held-out samples ``indices`` (at most ``batch_size``) as one padded batch of
    ``batch_size`` rows: rows past the samples hold byte 0 with every target ignored, so they
    count nothing (the stages only run the shapes they were set up with)."""
    batch = pad_batch(task.collate([task.eval_set[int(i)] for i in indices]), length)
    missing = batch_size - batch.inputs.shape[0]
    if missing <= 0:
        return batch
    return Batch(
        inputs=torch.cat([batch.inputs, batch.inputs.new_zeros(missing, length)]),
        targets=torch.cat([batch.targets, batch.targets.new_full((missing, length), IGNORE_INDEX)]),
        num_samples=batch.num_samples,
        num_tokens=batch.num_tokens,
        num_padded_tokens=batch_size * (length + 1),
    )
