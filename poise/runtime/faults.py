"""Injected failures, as data: which rank fails at which step.

Tests and demos of the failure path need a worker that dies at a known point, not a
random one (the torchft EventInjector idea). The plan is built once from the config and
checked at every step boundary; it never sleeps and never times anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from poise.config import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by a rank that the fault plan tells to fail."""


@dataclass(frozen=True)
class FaultPlan:
    """Crash ``crash_rank`` when it reaches ``crash_step`` (both -1: never)."""

    crash_rank: int = -1
    crash_step: int = -1

    @classmethod
    def from_config(cls, config: FaultConfig) -> FaultPlan:
        return cls(config.crash_rank, config.crash_step)

    def check(self, rank: int, step: int) -> None:
        """Raise :class:`InjectedFault` if this rank is planned to fail at this step."""
        if rank == self.crash_rank and step == self.crash_step:
            raise InjectedFault(f"injected fault: rank {rank} fails at step {step}")
