"""Re-measuring rank speeds while training and re-planning the split (the seed's DynamicPartitioner).

Every rank records, per step, the padded cost terms of its own batch (n·Lmax and n·Lmax²)
and its own compute seconds (from the timeline's probe, so waiting for others is excluded).
At re-plan steps the ranks exchange their last ``window_steps`` records with one small
all-gather, and every rank then computes the same thing from the same numbers:

1. α of the cost L + α·L² refitted from the window (when ``fit_alpha``), median over ranks;
2. each rank's speed = Σ cost / Σ compute seconds over the window;
3. target shares proportional to speed, with each rank's share moved by at most
   ``max_share_change`` (relative) per re-plan, so one noisy window cannot make the split
   oscillate;
4. the sampler splits the following steps with the new shares.

Schedule: the first ``cold_start_steps`` steps run on the equal split, the first re-plan
happens right after them, and then every ``replan_every_steps`` steps.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.balance.costs import AttentionCost, fit_alpha, measured_speeds
from poise.balance.sampler import BalancedBatchSampler

log = logging.getLogger(__name__)


def next_shares(current: np.ndarray, speeds: np.ndarray, max_change: float) -> np.ndarray:
    """Shares proportional to ``speeds``, each within ±``max_change`` (relative) of ``current``.

    Returns shares that sum to 1. Clipping and renormalising alternate until both hold (a
    few rounds; renormalising can only push a clipped share back inside its bounds).
    """
    current = np.asarray(current, dtype=np.float64) / np.sum(current)
    target = np.asarray(speeds, dtype=np.float64) / np.sum(speeds)
    low, high = current * (1 - max_change), current * (1 + max_change)
    shares = np.clip(target, low, high)
    for _ in range(50):
        shares = shares / shares.sum()
        clipped = np.clip(shares, low, high)
        if np.allclose(clipped, shares, rtol=0, atol=1e-12):
            break
        shares = clipped
    return shares / shares.sum()


@dataclass(frozen=True)
class Replan:
    """One re-plan, for logs and the report."""

    step: int
    speeds: list[float]  # cost units per second, per rank
    shares: list[float]
    alpha: float | None


class DynamicPartitioner:
    """Feeds measured speeds back into a :class:`BalancedBatchSampler` (see module doc)."""

    def __init__(
        self,
        sampler: BalancedBatchSampler,
        *,
        cold_start_steps: int = 10,
        window_steps: int = 50,
        replan_every_steps: int = 50,
        max_share_change: float = 0.15,
        fit_alpha: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.sampler = sampler
        self.cold_start_steps = cold_start_steps
        self.replan_every_steps = replan_every_steps
        self.max_share_change = max_share_change
        self.fit_alpha = fit_alpha and isinstance(sampler.cost_fn, AttentionCost) and sampler.cost_fn.alpha > 0
        self.device = device or torch.device("cpu")
        self.shares = np.full(sampler.world_size, 1.0 / sampler.world_size)
        self.window: deque[tuple[float, float, float]] = deque(maxlen=window_steps)
        self.history: list[Replan] = []

    def observe(self, batch_lengths: np.ndarray, compute_s: float) -> None:
        """Record this rank's step: its batch's lengths and its own compute seconds."""
        n, longest = len(batch_lengths), float(np.max(batch_lengths)) if len(batch_lengths) else 0.0
        self.window.append((n * longest, n * longest * longest, compute_s))

    def due(self, steps_done: int) -> bool:
        """Whether to re-plan before the next step, after ``steps_done`` steps in total."""
        since = steps_done - self.cold_start_steps
        return since >= 0 and since % self.replan_every_steps == 0 and len(self.window) > 0

    def replan(self, step: int) -> Replan:
        """Exchange windows (a collective: call on every rank at the same step) and re-split."""
        mine = torch.tensor(list(self.window), dtype=torch.float64, device=self.device)
        world = self.sampler.world_size
        if world > 1:
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            every = torch.stack(parts).cpu().numpy()  # [ranks, steps, 3]
        else:
            every = mine.cpu().numpy()[None]
        alpha = getattr(self.sampler.cost_fn, "alpha", None)
        if self.fit_alpha:
            fits = [fit_alpha(every[r, :, 0], every[r, :, 1], every[r, :, 2]) for r in range(world)]
            fits = [a for a in fits if a is not None]
            if fits:
                alpha = float(np.median(fits))
                self.sampler.set_cost_fn(AttentionCost(alpha))
        a = alpha or 0.0
        speeds = measured_speeds(every[:, :, 0] + a * every[:, :, 1], every[:, :, 2])
        self.shares = next_shares(self.shares, speeds, self.max_share_change)
        self.sampler.set_speeds(self.shares)
        event = Replan(step, speeds.tolist(), self.shares.tolist(), alpha)
        self.history.append(event)
        log.info(
            "re-plan at step %d: speeds %s cost/s, shares %s, alpha %s",
            step, [f"{s:,.0f}" for s in speeds], [f"{s:.3f}" for s in self.shares],
            "-" if alpha is None else f"{alpha:.2e}",
        )
        return event

    def state_dict(self) -> dict[str, Any]:
        return {"shares": self.shares.tolist(), "window": list(self.window),
                "history": [e.__dict__ for e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shares = np.asarray(state["shares"], dtype=np.float64)
        self.window.clear()
        self.window.extend(tuple(w) for w in state["window"])
        self.history = [Replan(**e) for e in state["history"]]
