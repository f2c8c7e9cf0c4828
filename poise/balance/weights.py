"""Exact gradients from unequal batches: each rank's loss weight for one step.

DDP averages the ranks' gradients, ``(1/W) Σ_r ∇loss_r``. With each rank's loss the mean
over its own batch's loss terms (tokens, samples, ...), that average weights every rank
equally, however many terms its batch holds: a rank given a third of the step's samples
counts as much as one given two thirds, and the gradient is biased toward the small batch.
Multiplying rank r's loss by ``W · n_r / Σ n`` before ``backward()`` turns DDP's average into
``Σ_r (n_r / Σ n) ∇loss_r``: the gradient of the mean loss over the whole step's batch, as a
single process would compute it. Every rank knows every rank's batch (the plan is computed
identically everywhere), so the weight costs no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def loss_weight(batches: Sequence[np.ndarray], rank: int, loss_terms: np.ndarray | None = None) -> float:
    """``world_size × (rank's loss terms / all ranks' loss terms)`` for one step.

    Args:
        batches: every rank's sample indices for the step (``sampler.global_batches(step)``).
        rank: this rank.
        loss_terms: loss terms per sample of the dataset (what the loss averages over: e.g.
            tokens − 1 for a language model); None counts one per sample.

    Returns 1.0 for a step without any loss term.
    """
    if loss_terms is None:
        counts = np.array([len(b) for b in batches], dtype=np.float64)
    else:
        counts = np.array([loss_terms[b].sum() for b in batches], dtype=np.float64)
    total = counts.sum()
    return float(len(batches) * counts[rank] / total) if total > 0 else 1.0
