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
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

from poise.balance.costs import AttentionCost
from poise.balance.rebalance import Replan
from poise.balance.sampler import BalancedBatchSampler

MAX_REPLAY_BYTES = 64 << 20  # a report of a very long run is a few MB
MAX_STEP = 1 << 53  # more steps than any run takes


def load_replans(path: str | Path, world_size: int | None) -> list[Replan]:
    """The re-plans recorded in ``path`` (a report.json, or a JSON list of its ``replans``
    entries), in step order, checked for ``world_size`` ranks (any number when None: the
    command checks the file before it knows the world size of an elastic job).

    Only a regular file is read, and at most :data:`MAX_REPLAY_BYTES` of it: ``/dev/zero``
    would be read until memory ran out, and a FIFO waited on forever.

    Raises:
        ValueError: one line naming the file and what is wrong with it.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO is refused below, not waited on
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"balance.replay={str(path)!r} is not a regular file: give a run's report.json")
            data = handle.read(MAX_REPLAY_BYTES + 1)
        if len(data) > MAX_REPLAY_BYTES:
            raise ValueError(f"balance.replay={str(path)!r} is larger than {MAX_REPLAY_BYTES} bytes: not a "
                             "report.json")
        data = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"balance.replay={str(path)!r} is not a readable JSON file: "
                         f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from None
    except ValueError as exc:  # not JSON, or an integer past Python's digit limit
        if str(exc).startswith("balance.replay="):
            raise
        raise ValueError(f"balance.replay={str(path)!r} is not a readable JSON file: "
                         f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from None
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
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"{where}: step {str(step)[:40]} is not a count of steps (0 to {MAX_STEP})")
    ranks = world_size if world_size is not None else len(shares) if isinstance(shares, list) else 0
    if (not isinstance(shares, list) or not shares or len(shares) != ranks
            or not all(_positive(s) for s in shares)):
        raise ValueError(f"{where}: shares {str(shares)[:80]} are not {ranks or 'some'} positive numbers (a run "
                         f"with {ranks or 'that many'} ranks)")
    if alpha is not None and not (_positive(alpha) or alpha == 0):
        raise ValueError(f"{where}: alpha {str(alpha)[:40]} is not a number >= 0")
    if alphas is not None and (not isinstance(alphas, list) or len(alphas) != ranks
                               or not all(_positive(a) or a == 0 for a in alphas)):
        raise ValueError(f"{where}: rank_alphas {str(alphas)[:80]} are not {ranks} numbers >= 0")
    # speeds: the shares stand for them (a replay measures nothing)
    return Replan(step=step, speeds=[float(s) for s in shares], shares=[float(s) for s in shares],
                  alpha=None if alpha is None else float(alpha), decision="replay",
                  rank_alphas=None if alphas is None else [float(a) for a in alphas])


def _positive(value: Any) -> bool:
    """A finite number > 0 that a float holds (an integer of 400 digits is none)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value)) and value > 0
    except OverflowError:
        return False


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
