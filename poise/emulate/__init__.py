"""Emulation for tests, benchmarks and demos: slower ranks, speed noise, delays, faults.

Every emulation stands for something a real cluster does to a job (a slower device,
contention, stalls, a lost worker), so that balancing, deadline steps and recovery can be
tried and measured on one machine. Reports say when a run was emulated. None of it is called
from inside the training step: :func:`emulation_for` builds an :class:`Emulation` from the
``emulate`` config section, and the session's builder (``poise/run/build.py``) installs it
around the step through generic seams only:

- step listeners, told when a step begins and ends (the speed and noise of the step; the
  injected kill before a planned step): :mod:`poise.emulate.speed`, :mod:`poise.emulate.faults`;
- a forward hook on the model and a wrapper around the DDP comm hook (sleeps that stretch
  forward and backward): :class:`poise.emulate.speed.Slowdown`;
- the deadline strategy's pauses (delays injected between micro-batches):
  :mod:`poise.emulate.delays`;
- the DataLoader's collate function (a slower input pipeline): :meth:`Emulation.wrap_collate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import default_collate

from poise.config import EmulateConfig
from poise.emulate.delays import DelayModel
from poise.emulate.faults import FaultPlan, InjectedKill
from poise.emulate.speed import Slowdown, apply_slowdown


@dataclass
class Emulation:
    """What is emulated on this rank, ready to install (see module doc).

    Attributes:
        slowdown: this rank's speed and noise (a step listener, forward hook and hook wrapper).
        faults: the planned kill and the slower input pipeline.
        delays: the delays injected between micro-batches (the deadline strategy's pauses),
            or None when none are asked for.
        listeners: what the step tells when a step begins and ends.
    """

    slowdown: Slowdown
    faults: FaultPlan
    delays: DelayModel | None
    listeners: list[Any] = field(default_factory=list)

    def install(self, model: nn.Module) -> None:
        """Stretch ``model``'s forward (sleeping) when this rank is slowed or noisy."""
        if self.slowdown.sleeps:
            model.register_forward_hook(self.slowdown.forward_hook)

    def wrap_collate(self, collate: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
        """``collate`` slowed by the emulated input pipeline (itself when there is none)."""
        if collate is None and self.faults.data_delay_s <= 0:
            return None
        return self.faults.wrap_collate(collate if collate is not None else default_collate)

    def describe(self) -> dict[str, Any]:
        """This rank's emulated slowness, for the report (speed 1.0, method 'none': not slowed)."""
        s = self.slowdown
        return {"speed": s.speed, "method": s.method, "from_step": s.from_step, "until_step": s.until_step,
                "noise": s.noise}


def emulation_for(config: EmulateConfig, *, rank: int, threads: int, seed: int) -> Emulation:
    """This rank's :class:`Emulation` of ``config`` (nothing emulated for the defaults).

    ``threads``: the CPUs a full-speed rank uses (the CPU quota of a slowed one is a share of
    them); ``seed``: the run's seed (noise and delays are drawn from it).

    Raises:
        OSError: ``slowdown_method='cgroup'`` asked for where cgroups cannot be written.
    """
    slowdown = apply_slowdown(rank, config.rank_speeds(), config.slowdown_method, threads,
                              noise=config.speed_noise, seed=seed, noise_steps=config.speed_noise_steps)
    faults = FaultPlan.from_config(config)
    delays = DelayModel.from_spec(config.delay_spec(), seed=seed) if config.delay else None
    listeners: list[Any] = [slowdown]
    if faults.rank == rank:
        listeners.append(InjectedKill(faults, rank))
    return Emulation(slowdown=slowdown, faults=faults, delays=delays, listeners=listeners)


__all__ = ["Emulation", "emulation_for"]
