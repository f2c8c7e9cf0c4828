"""How balanced a set of workers (or pipeline stages) is.

The product's headline metric (from the seed document): for per-worker times Tᵢ of one
step, balance = 1 − (max Tᵢ − min Tᵢ) / max Tᵢ. 1.0 is perfect; 0.5 means the fastest
worker idles half of the step. Idle fraction says the same thing in rank-seconds: the
share of all workers' time spent waiting for the slowest one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def balance(times: Sequence[float] | np.ndarray) -> float:
    """1 − (max − min) / max of per-worker times in seconds (1.0 for one worker or all zero).

    Raises:
        ValueError: if ``times`` is empty or holds a negative or non-finite value.
    """
    t = np.asarray(times, dtype=np.float64)
    if t.size == 0:
        raise ValueError("balance() needs at least one time, got none")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"balance() needs finite times >= 0 seconds, got {t.tolist()}")
    top = float(t.max())
    return 1.0 if top == 0.0 else 1.0 - (top - float(t.min())) / top


def idle_fraction(compute_s: np.ndarray) -> float:
    """Share of rank-seconds spent waiting for the slowest rank.

    Args:
        compute_s: array ``[steps, ranks]`` of each rank's compute seconds per step.

    Returns:
        Σ_steps Σ_ranks (max_rank T − T) / Σ_steps (ranks · max_rank T), in [0, 1).
    """
    t = np.asarray(compute_s, dtype=np.float64)
    if t.ndim != 2 or t.size == 0:
        raise ValueError(f"idle_fraction() needs a [steps, ranks] array, got shape {t.shape}")
    slowest = t.max(axis=1, keepdims=True)
    total = float((slowest * t.shape[1]).sum())
    return 0.0 if total == 0.0 else float((slowest - t).sum()) / total
