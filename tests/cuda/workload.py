"""A small regression workload the ``cuda`` tests train: unequal samples, a token-mean loss.

Samples have unequal lengths, so balanced batches differ in size across ranks and the loss
weight matters: the exact gradient of a step is the token mean over every rank's samples.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

LENGTHS = np.random.default_rng(0).integers(4, 24, size=256)
FEATURES = 8


class Rows(Dataset):
    """Sample i: ``LENGTHS[i]`` rows of features and one target per row (seeded by i)."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(i))
        return torch.rand(int(LENGTHS[i]), FEATURES, generator=g), torch.rand(int(LENGTHS[i]), 1, generator=g)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded to the longest sample; padding targets are NaN (no loss term)."""
    longest = max(len(x) for x, _ in samples)
    x = torch.zeros(len(samples), longest, FEATURES)
    y = torch.full((len(samples), longest, 1), float("nan"))
    for k, (a, b) in enumerate(samples):
        x[k, : len(a)], y[k, : len(b)] = a, b
    return x, y


def token_mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real rows of the batch (one loss term per row)."""
    real = ~torch.isnan(y)
    return F.mse_loss(model(x)[real], y[real])


def make_model(device: torch.device) -> nn.Module:
    """The same initial weights in every process (seeded), on ``device``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)


def whole_step_grads(device: torch.device, indices: list[list[int]]) -> list[torch.Tensor]:
    """The gradient of the token-mean loss over every rank's samples of one step, computed in
    one process on a fresh copy of the model: what the reduced gradient must equal."""
    model = make_model(device)
    x, y = collate([Rows()[i] for rank in indices for i in rank])
    token_mean_loss(model, x.to(device), y.to(device)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]
