"""Injected failures, as data: which rank dies at which step, and a slow input pipeline.

Tests and demos of the failure path need a worker that dies at a known point, not a
random one (the torchft EventInjector idea). The plan is built once from the config and
checked at every step boundary. The death is a real one: the process sends itself SIGKILL,
so nothing is flushed, no exception handler runs and the launcher sees a killed worker,
exactly like an out-of-memory kill or a lost machine. It happens in the launcher's first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so that a restarted job can get past it.

``data_delay_s`` emulates a slow input pipeline (storage, decoding, a busy host): every batch
takes that much longer to load on every rank. It is installed around the step, in the
DataLoader's collate function (:meth:`FaultPlan.wrap_collate`, applied by
``Session.dataloader``), so the session measures it as data time exactly as it would a real
slow loader. The kill is a step listener (:class:`InjectedKill`), told when a step begins:
nothing inside the step knows about either.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poise.config import EmulateConfig
from poise.runtime.dist import restart_count

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultPlan:
    """Kill ``rank`` when it reaches ``step`` (None: never), in the first attempt only."""

    rank: int | None = None
    step: int | None = None
    data_delay_s: float = 0.0  # extra seconds to load every batch, every rank

    @classmethod
    def from_config(cls, config: EmulateConfig) -> FaultPlan:
        planned = config.rank_step()
        rank, step = planned if planned else (None, None)
        return cls(rank, step, data_delay_s=config.data_delay_s)

    def wrap_collate(self, collate: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``collate``, slowed by ``data_delay_s`` per batch (itself when there is no delay)."""
        if self.data_delay_s <= 0:
            return collate
        delay_s = self.data_delay_s

        def slow_collate(batch: Any) -> Any:
            time.sleep(delay_s)
            return collate(batch)

        log.warning("injected fault: every batch loads %.3f s slower (emulate.data_delay_s)", delay_s)
        return slow_collate

    def due(self, rank: int, step: int, attempt: int) -> bool:
        """Whether this rank must die before ``step`` in launcher attempt ``attempt``."""
        return attempt == 0 and rank == self.rank and step == self.step

    def check(self, rank: int, step: int) -> None:
        """Kill this process (SIGKILL) if the plan says so; return otherwise."""
        if self.due(rank, step, restart_count()):
            log.warning("injected fault: rank %d kills itself before step %d", rank, step)
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class InjectedKill:
    """A step listener that kills this rank when its planned step begins (see module doc)."""

    plan: FaultPlan
    rank: int

    def step_began(self, index: int) -> None:
        self.plan.check(self.rank, index)

    def step_ended(self, index: int) -> None:
        """Nothing: the kill comes before a step."""

    def injected_s(self) -> float:
        return 0.0
