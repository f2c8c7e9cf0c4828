"""Emulated heterogeneity: make one rank run at a fraction of its speed (``--rank-speed 1:0.5``).

This is an emulation for tests and benchmarks, and reports say so. The slowdown scales with
the work done — a rank at speed 0.5 takes twice as long for the same batch — so a balancer
has something real to learn; it is never a constant delay. Two methods:

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

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_PERIOD_US = 10_000  # short periods: the throttled rank is slowed evenly, not in 50 ms bursts
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
_V2_ROOT = Path("/sys/fs/cgroup")
_LEAVE: list[Callable[[], None]] = []  # this process's group, left and removed by leave_cgroup()


@dataclass
class Slowdown:
    """How this rank is slowed: ``speed`` in (0, 1], ``method`` none, cgroup or sleep.

    ``mark_s`` is the ``perf_counter()`` time the current stretch of compute began; the
    training step sets it before forward and backward. None until then: a backward outside
    the training step (the resume path's throw-away step) has no stretch to slow.
    """

    speed: float = 1.0
    method: str = "none"
    mark_s: float | None = field(default=None, repr=False)

    def stretch(self) -> None:
        """With the sleep method, sleep (1/speed − 1) × the compute since ``mark_s``; re-mark."""
        if self.method == "sleep" and self.speed < 1.0 and self.mark_s is not None:
            time.sleep((1.0 / self.speed - 1.0) * max(0.0, time.perf_counter() - self.mark_s))
        self.mark_s = time.perf_counter()

    def wrap_hook(self, hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
                  ) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
        """A DDP comm hook that first stretches the backward compute up to this bucket.

        Wrap *outside* the timing probe, so the probe sees the bucket after the sleep and
        counts it as compute. (DDP reads the annotations: no postponed annotations here.)
        """
        if self.method != "sleep":
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
    return group


def leave_cgroup() -> None:
    """Leave and remove this process's slowdown cgroup, if it made one. Workers end through
    ``os._exit`` (poise/runtime/entry.py), which skips ``atexit``: entry.leave calls this."""
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


def apply_slowdown(rank: int, rank_speeds: dict[int, float], method: str, threads: int) -> Slowdown:
    """Slow this rank as configured (``method`` auto, cgroup or sleep); returns what ran.

    Raises:
        OSError: when ``method='cgroup'`` was asked for and cgroups cannot be written.
    """
    speed = rank_speeds.get(rank, 1.0)
    if speed >= 1.0:
        return Slowdown()
    if method in ("auto", "cgroup"):
        try:
            group = _limit_with_cgroup(speed, threads)
        except OSError as exc:
            if method == "cgroup":
                raise OSError(f"balance.slowdown_method='cgroup' but the CPU cgroup is not usable: {exc}") from exc
            log.warning("rank %d: no cgroup CPU quota (%s); sleeping instead", rank, exc)
        else:
            log.warning("rank %d runs at emulated speed %.2f: CPU quota %.2f CPUs in %s", rank, speed,
                        speed * threads, group)
            return Slowdown(speed, "cgroup")
    log.warning("rank %d runs at emulated speed %.2f: sleeping in proportion to its compute", rank, speed)
    return Slowdown(speed, "sleep")
