"""Replay a recorded plan: balance ``dynamic`` made reproducible.

A dynamic run re-plans from measured speeds, and measured speeds differ from run to run: the
same seed gives other batches after the first re-plan. To repeat a run exactly (to debug it,
to compare a change of model or codec against the same data order), :class:`ReplayedPartitioner`
applies the re-plans a run recorded in its ``report.json`` (``replans``: the step, the shares,
the cost model's α) at the same steps, measuring nothing and exchanging nothing. The batches
then follow from the seed and the recording alone.

``load_replans`` reads the recording: a ``report.json`` (its ``replans``) or a list of such
entries, bounded in size and checked entry by entry before anything is applied.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from poise.balance.costs import AttentionCost
from poise.balance.rebalance import Replan
from poise.balance.sampler import BalancedBatchSampler

MAX_REPLAY_BYTES = 64 << 20  # a report of a very long run is a few MB


def load_replans(path: str | Path, world_size: int) -> list[Replan]:
    """The re-plans recorded in ``path`` (a report.json, or a JSON list of its ``replans``
    entries), in step order, checked for ``world_size`` ranks.

    Raises:
        ValueError: one line naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_REPLAY_BYTES:
            raise ValueError(f"balance.replay={str(path)!r} is {size} bytes: at most {MAX_REPLAY_BYTES} are read")
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"balance.replay={str(path)!r} is not a readable JSON file: "
                         f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
    entries = data.get("replans") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"balance.replay={str(path)!r} holds no re-plans: give the report.json of a run with "
                         "balance dynamic (its 'replans' list)")
    replans = [_replan(path, i, e, world_size) for i, e in enumerate(entries)]
    steps = [r.step for r in replans]
    if steps != sorted(set(steps)):
        raise ValueError(f"balance.replay={str(path)!r}: re-plan steps {steps[:8]}... are not increasing")
    return replans


def _replan(path: Path, i: int, entry: Any, world_size: int) -> Replan:
    where = f"balance.replay={str(path)!r}: re-plan {i}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not an object")
    step, shares, alpha, alphas = entry.get("step"), entry.get("shares"), entry.get("alpha"), entry.get("rank_alphas")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"{where}: step {step!r} is not a count of steps")
    if (not isinstance(shares, list) or len(shares) != world_size
            or not all(_positive(s) for s in shares)):
        raise ValueError(f"{where}: shares {shares!r} are not {world_size} positive numbers (a run with "
                         f"{world_size} ranks)")
    if alpha is not None and not (_positive(alpha) or alpha == 0):
        raise ValueError(f"{where}: alpha {alpha!r} is not a number >= 0")
    if alphas is not None and (not isinstance(alphas, list) or len(alphas) != world_size
                               or not all(_positive(a) or a == 0 for a in alphas)):
        raise ValueError(f"{where}: rank_alphas {alphas!r} are not {world_size} numbers >= 0")
    # speeds: the shares stand for them (a replay measures nothing)
    return Replan(step=step, speeds=[float(s) for s in shares], shares=[float(s) for s in shares],
                  alpha=None if alpha is None else float(alpha), decision="replay",
                  rank_alphas=None if alphas is None else [float(a) for a in alphas])


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


class ReplayedPartitioner:
    """Applies recorded re-plans to ``sampler`` at their steps (see module doc); the same face
    as :class:`~poise.balance.rebalance.DynamicPartitioner` to the session."""

    def __init__(self, sampler: BalancedBatchSampler, replans: list[Replan]) -> None:
        self.sampler = sampler
        self.pending = list(replans)
        self.shares = np.full(sampler.world_size, 1.0 / sampler.world_size)
        self.history: list[Replan] = []

    def observe(self, batch_lengths: np.ndarray, compute_s: float) -> None:
        """Nothing: a replay measures nothing."""

    def after_step(self, recorded: int, steps_done: int, last_step: int | None = None) -> None:
        """Apply the re-plan recorded at ``steps_done`` (no collective: every rank applies the same)."""
        while self.pending and self.pending[0].step < steps_done:  # before a resumed run's start
            self.pending.pop(0)
        if self.pending and self.pending[0].step == steps_done:
            self._apply(self.pending.pop(0))

    def _apply(self, event: Replan) -> None:
        if event.rank_alphas is not None:  # the run fitted α: its cost model as it was then
            if event.alpha is not None:
                self.sampler.set_cost_fn(AttentionCost(event.alpha))
            own = np.array(event.rank_alphas)
            self.sampler.set_rank_cost_fns([AttentionCost(float(a)) for a in own]
                                           if event.alpha is None or np.any(own != event.alpha) else None)
        self.shares = np.array(event.shares)
        self.sampler.set_speeds(self.shares)
        self.history.append(event)

    def state_dict(self) -> dict[str, Any]:
        return {"shares": self.shares.tolist(), "window": [], "history": [e.__dict__ for e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shares = np.asarray(state.get("shares", self.shares), dtype=np.float64)


__all__ = ["MAX_REPLAY_BYTES", "ReplayedPartitioner", "load_replans"]
