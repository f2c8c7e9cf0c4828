"""Emulated heterogeneity: make one rank run at a fraction of its speed (``--rank-speed 1:0.5``).

Installed around the training step, never called from inside it: :class:`Slowdown` is a
step listener (told when a step begins and ends), a forward hook on the model (stretches the
forward) and a wrapper around the DDP comm hook (stretches backward up to each bucket).

This is an emulation for tests and benchmarks, and reports say so. The slowdown scales with
the work done — a rank at speed 0.5 takes twice as long for the same batch — so a balancer
has something real to learn; it is never a constant delay. ``1:0.5@80`` slows rank 1 from
step 80 on (a device that degrades mid-run). ``emulate.speed_noise`` adds noise to every
rank: each step's compute is stretched by ``1 + X``, ``X`` exponential with that mean (drawn
per rank and step from the run's seed; with ``emulate.speed_noise_steps`` N, one draw holds
for N steps in a row: bursts of contention, as other jobs on a host cause), always by
sleeping. Two methods for the speed:

- ``cgroup``: a real CPU quota from the kernel's CPU controller (cgroup v1 ``cpu`` or v2
  ``cpu.max``): the process gets ``speed × threads`` CPUs. Needs root and a writable cgroup fs.
- ``sleep``: after each stretch of compute (forward; backward up to each gradient bucket),
  sleep ``(1/speed − 1) ×`` its length. Works anywhere; the time counts as compute.

``auto`` tries the cgroup and falls back to sleeping, logging which one ran.
"""

import atexit
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.runtime import dist as rdist

log = logging.getLogger(__name__)

_PERIOD_US = 10_000  # short periods: the throttled rank is slowed evenly, not in 50 ms bursts
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")
_LEAVE: list[Callable[[], None]] = []  # this process's group, left and removed by leave_cgroup()


@dataclass
class Slowdown:
    """How this rank is slowed: ``speed`` in (0, 1], ``method`` none, cgroup or sleep.

    ``mark_s`` is the time the current stretch of compute began; the training step sets it
    before forward and backward. None until then: a backward outside the training step (the
    resume path's throw-away step) has no stretch to slow. The time is ``perf_counter()``, or
    with ``by_cpu`` this process's CPU seconds: a sharded model's forward and backward block in
    FSDP2's collectives, and a stretch of wall time would slow the rank by its waits for the
    others too (under FSDP2 a rank at half speed then measured a third, and less as its share
    fell, and the balancer starved it).
    """

    speed: float = 1.0
    method: str = "none"
    from_step: int = 0  # slowed from this step on
    until_step: int | None = None  # ... and back to full speed from this step (None: to the end)
    noise: float = 0.0  # mean of the per-step exponential stretch X (0: none)
    noise_steps: int = 1  # steps that share one draw of X (bursts)
    seed: int = 0
    threads: int = 1  # CPUs of the full-speed quota (cgroup method)
    group: Path | None = field(default=None, repr=False)  # the cgroup (cgroup method)
    mark_s: float | None = field(default=None, repr=False)
    by_cpu: bool = False  # stretch by CPU seconds, not wall seconds (see class doc)
    _extra: float = field(default=0.0, repr=False)  # this step's sleep per second of compute
    slept_s: float = field(default=0.0, repr=False)  # seconds slept in stretches since the step began
    _lowered: bool = field(default=False, repr=False)  # cgroup: the quota is the slowed one

    def begin_step(self, step: int) -> None:
        """Set this step's slowness: the speed from ``from_step`` until ``until_step``, and the noise."""
        slowed = self.speed < 1.0 and self.from_step <= step and (self.until_step is None or step < self.until_step)
        if self.method == "cgroup" and self.group is not None and slowed != self._lowered:
            # from_step reached (or a resumed run past it), or until_step: the quota follows
            _set_quota(self.group, (self.speed if slowed else 1.0) * self.threads)
            self._lowered = slowed
        factor = 1.0 / self.speed if self.method == "sleep" and slowed else 1.0
        if self.noise > 0:
            factor *= 1.0 + float(np.random.default_rng([self.seed, step // self.noise_steps]).exponential(self.noise))
        self._extra = factor - 1.0
        self.slept_s = 0.0

    def stretch(self) -> None:
        """Sleep this step's extra share of the compute since ``mark_s`` (nothing when not
        slowed, or before the first step began); re-mark."""
        if self._extra > 0 and self.mark_s is not None:
            seconds = self._extra * max(0.0, self._now() - self.mark_s)
            time.sleep(seconds)
            self.slept_s += seconds
        self.mark_s = self._now()

    def _now(self) -> float:
        return time.process_time() if self.by_cpu else time.perf_counter()

    # -- installed around the step (poise/emulate/__init__.py) --------------------------------

    def step_began(self, index: int) -> None:
        """A step opens: its slowness, and its compute counts from now."""
        self.begin_step(index)
        self.mark_s = self._now()

    def step_ended(self, index: int) -> None:
        """A step closed: nothing outside a step (an evaluation, a throw-away backward) is slowed."""
        self.mark_s = None

    def injected_s(self) -> float:
        """Seconds slept in this step's compute (the record leaves them out of the compute seconds)."""
        return self.slept_s

    def forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """A forward hook: stretch the forward just run (``module.register_forward_hook``)."""
        self.stretch()

    @property
    def sleeps(self) -> bool:
        """Whether this rank's compute is stretched by sleeping (speed by sleeps, or noise)."""
        return self.method == "sleep" or self.noise > 0

    def wrap_hook(self, hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
                  ) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        """A DDP comm hook that first stretches the backward compute up to this bucket.

        Wrap *outside* the timing probe, so the probe sees the bucket after the sleep and
        counts it as compute. (DDP reads the annotations: no postponed annotations here.)
        """
        if not self.sleeps:
            return hook

        def slowed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.stretch()
            return hook(state, bucket)

        return slowed_hook


def _cpu_cgroup() -> tuple[Path, str] | None:
    """(parent directory, 'v1' | 'v2') of a writable CPU controller, or None."""
    if (_V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(_V1_ROOT, os.W_OK):
        return _V1_ROOT, "v1"
    controllers = _V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(_V2_ROOT, os.W_OK):
        return _V2_ROOT, "v2"
    return None


def _limit_with_cgroup(speed: float, threads: int) -> Path:
    """Put this process in a new cgroup with a CPU quota of ``speed × threads`` CPUs."""
    found = _cpu_cgroup()
    if found is None:
        raise OSError("no writable cgroup CPU controller")
    root, version = found
    remove_stale_groups()
    group = root / f"poise-slow-{os.getpid()}"
    group.mkdir(exist_ok=True)
    quota = max(1000, int(speed * threads * _PERIOD_US))
    if version == "v1":
        (group / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")
    (group / "cgroup.procs").write_text(str(os.getpid()))

    def leave() -> None:
        # Move back to the parent so the empty group can be removed.
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(str(os.getpid()))
            group.rmdir()

    _LEAVE.append(leave)
    atexit.register(leave_cgroup)
    rdist.on_exit(leave_cgroup)  # workers end through os._exit, which skips atexit
    return group


def _set_quota(group: Path, cpus: float) -> None:
    """Change the CPU quota of ``group`` (made by :func:`_limit_with_cgroup`) to ``cpus`` CPUs."""
    quota = max(1000, int(cpus * _PERIOD_US))
    if (group / "cpu.cfs_quota_us").exists():
        (group / "cpu.cfs_quota_us").write_text(str(quota))
    else:
        (group / "cpu.max").write_text(f"{quota} {_PERIOD_US}")


def leave_cgroup() -> None:
    """Leave and remove this process's slowdown cgroup, if it made one. Workers end through
    ``os._exit``, which skips ``atexit``: :func:`poise.runtime.dist.exit_process` calls this."""
    while _LEAVE:
        _LEAVE.pop()()


def remove_stale_groups() -> list[Path]:
    """Remove the slowdown cgroups of processes that are gone (killed workers cannot remove their
    own); the kernel refuses to remove a group that still has processes. Returns those removed."""
    found = _cpu_cgroup()
    if found is None:
        return []
    removed = []
    for stale in found[0].glob("poise-slow-*"):
        pid = stale.name.removeprefix("poise-slow-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                stale.rmdir()
                removed.append(stale)
    return removed


def apply_slowdown(rank: int, rank_speeds: dict[int, tuple[float, int, int | None]], method: str, threads: int,
                   noise: float = 0.0, seed: int = 0, noise_steps: int = 1) -> Slowdown:
    """Slow this rank as configured (``rank_speeds``: rank -> (speed, from step, until step or
    None); ``method`` auto,
    cgroup or sleep); returns what runs. Call :meth:`Slowdown.begin_step` at every step.

    Raises:
        OSError: when ``method='cgroup'`` was asked for and cgroups cannot be written.
    """
    speed, from_step, until_step = rank_speeds.get(rank, (1.0, 0, None))
    noisy = {"noise": noise, "seed": seed * 1000 + rank, "noise_steps": noise_steps}
    if speed >= 1.0:
        return Slowdown(**noisy)
    if method in ("auto", "cgroup"):
        try:
            # full speed until from_step: the quota is lowered then (begin_step)
            group = _limit_with_cgroup(speed if from_step == 0 else 1.0, threads)
            lowered = from_step == 0
        except OSError as exc:
            if method == "cgroup":
                raise OSError(f"emulate.slowdown_method='cgroup' but the CPU cgroup is not usable: {exc}") from exc
            log.warning("rank %d: no cgroup CPU quota (%s); sleeping instead", rank, exc)
        else:
            log.warning("rank %d runs at emulated speed %.2f from step %d: CPU quota %.2f CPUs in %s", rank, speed,
                        from_step, speed * threads, group)
            return Slowdown(speed, "cgroup", from_step, until_step, threads=threads, group=group, _lowered=lowered,
                            **noisy)
    log.warning("rank %d runs at emulated speed %.2f from step %d: sleeping in proportion to its compute", rank,
                speed, from_step)
    return Slowdown(speed, "sleep", from_step, until_step, **noisy)
