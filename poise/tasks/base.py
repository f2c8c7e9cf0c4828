"""The contract between the training runtime and a task (data + model + metrics).

The runtime never knows what a task trains: it asks the task for its datasets, the
per-sample length metadata (the cost of a sample, known without loading it), a model,
a collate function and two pure functions that turn a model and a batch into a loss
(training) or summed metrics (evaluation). Keeping this surface small is what lets the
balancing and communication layers treat every task the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Batch:
    """One collated batch.

    Attributes:
        inputs: model input tensor (e.g. byte ids ``[B, L]`` or images ``[B, 1, 8, 8]``).
        targets: target tensor; padded positions hold ``IGNORE_INDEX``.
        num_samples: real samples in the batch.
        num_tokens: real tokens (bytes for code-lm, 1 per image for digits), padding excluded.
        num_padded_tokens: tokens the model computes on, padding included (samples × longest).
        rows: packed rows only: each row's documents' lengths in tokens, in order (a row's
            padding follows its last document); None for a batch of padded samples.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    num_samples: int
    num_tokens: int
    num_padded_tokens: int
    rows: tuple[tuple[int, ...], ...] | None = None

    def to(self, device: torch.device) -> Batch:
        return Batch(
            inputs=self.inputs.to(device, non_blocking=True),
            targets=self.targets.to(device, non_blocking=True),
            num_samples=self.num_samples,
            num_tokens=self.num_tokens,
            num_padded_tokens=self.num_padded_tokens,
            rows=self.rows,
        )


IGNORE_INDEX = -100


@dataclass(frozen=True)
class EvalSums:
    """Sums over evaluated targets, so ranks can add them with one all-reduce.

    Attributes:
        loss_sum: summed cross-entropy in nats over all evaluated targets.
        correct: number of targets predicted exactly (arg-max).
        count: number of evaluated targets (bytes for code-lm, images for digits).
    """

    loss_sum: float
    correct: float
    count: float


@dataclass(frozen=True)
class Task:
    """Everything the runtime needs to train and evaluate one task.

    Attributes:
        name: registry name (``code-lm``, ``digits``).
        train_set: map-style dataset of training samples.
        eval_set: map-style dataset of held-out samples.
        train_lengths: length of every training sample in tokens (int64, ``len(train_set)``);
            the cost metadata that samplers and balancers read instead of loading samples.
        train_targets: loss terms per training sample (what ``train_loss`` averages over:
            bytes − 1 for code-lm, 1 per image); weights ranks' gradients when batches differ.
        cost_alpha: prior α of the per-sample cost L + α·L² (0 for tasks whose cost is linear).
        build_model: returns a fresh, deterministic-given-seed model.
        collate: turns a list of samples into a :class:`Batch`.
        train_loss: ``(model, batch) -> scalar loss`` averaged over the batch's real tokens.
        eval_sums: ``(model, batch) -> EvalSums`` for the batch (no grad is taken by the caller).
        loss_unit: how to read ``eval_loss`` (``bits/byte`` or ``nats/sample``).
        default_batch_size: samples per rank per step when the user gives none.
        default_lr: learning rate when the user gives none.
        row_tokens: packed rows of this many tokens (``collate`` fills rows with documents,
            attention per document); None: batches of padded samples.
    """

    name: str
    train_set: Dataset[Any]
    eval_set: Dataset[Any]
    train_lengths: np.ndarray
    train_targets: np.ndarray
    cost_alpha: float
    build_model: Callable[[], nn.Module]
    collate: Callable[[Sequence[Any]], Batch]
    train_loss: Callable[[nn.Module, Batch], torch.Tensor]
    eval_sums: Callable[[nn.Module, Batch], EvalSums]
    loss_unit: str
    default_batch_size: int
    default_lr: float
    row_tokens: int | None = None

    def loss_in_unit(self, nats: float) -> float:
        """Convert a mean loss in nats to ``loss_unit`` (bits per byte divide by ln 2)."""
        return nats / math.log(2) if self.loss_unit == "bits/byte" else nats
