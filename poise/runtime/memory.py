"""Keeping the memory one training step frees for the next one (glibc's malloc, CPU tensors).

Why: glibc serves every allocation over its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, so a CPU training step pays a page fault
for every 4 KiB page of its large activations, every step. Two ranks of code-lm on one 2-core
machine took 5 million faults in 90 steps of varied shapes. The cost is not even noise: the
rank with the larger share has more of its tensors over the threshold, so on the largest steps
it ran 4-16 % slower per cost unit than its cost model while its half-speed peer did not
(``poise bench balance``, run c, 9 runs in ``runs/s40-*-c-*``, ``runs/s41-plain-c-*``), and the
dynamic balancer cannot plan for a cost that depends on the step's size. With the memory kept
(the same runs under ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``, interleaved with plain ones,
``runs/s41-nommap-c-*``), that bias vanished and the balance once converged read 0.970 against
0.950 (medians of 6).

What: ``mallopt(M_MMAP_MAX, 0)`` (no allocation is served by ``mmap``) and the largest trim
threshold (the heap's free top is not given back), so a step reuses the pages of the last one.
PyTorch's CUDA caching allocator makes the same trade on the GPU. The price is fragmentation:
freed holes that a later, differently shaped tensor does not fit. In a single process of 150
steps of varied shapes the heap held 3.2 GB for 0.14 GB in use, and resident memory kept
growing. So :meth:`FreedMemory.after_step` bounds it: when resident memory exceeds
``growth`` times its reference (the largest of the first steps, or after the last trim), it
calls ``malloc_trim(0)``, which gives every free page back (the next steps fault them in once
more) and resets the reference. Resident memory is therefore at most ``growth`` times what
the job needs, and the faults are paid once per trim instead of every step.

Only glibc (Linux) has these knobs; elsewhere :func:`keep_freed_memory` changes nothing and
says so (returns None).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set (2 GiB)
GROWTH = 2.0  # resident memory allowed over its reference before the free pages are given back
REFERENCE_STEPS = 5  # the first steps, whose largest resident size is the reference


def resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class FreedMemory:
    """The installed policy (see module doc): call :meth:`after_step` once per training step.

    Attributes:
        growth: resident memory over the reference that makes it give free pages back (ratio).
        trims: how many times it did so.
        reference_bytes: the resident size it compares with, in bytes.
    """

    libc: ctypes.CDLL = field(repr=False)
    growth: float = GROWTH
    trims: int = 0
    reference_bytes: int = 0
    _steps: int = 0

    def after_step(self) -> bool:
        """Give free pages back when resident memory outgrew its bound; returns whether it did.

        One read of ``/proc/self/statm`` per call (microseconds)."""
        self._steps += 1
        rss = resident_bytes()
        if self._steps <= REFERENCE_STEPS or self.reference_bytes == 0:
            self.reference_bytes = max(self.reference_bytes, rss)
            return False
        if rss <= self.growth * self.reference_bytes:
            return False
        self.libc.malloc_trim(0)
        after = resident_bytes()
        log.info("resident memory %.0f MB over %.1fx its reference (%.0f MB): free pages given back, now %.0f MB",
                 rss / 1e6, self.growth, self.reference_bytes / 1e6, after / 1e6)
        self.trims += 1
        self.reference_bytes = max(self.reference_bytes, after)
        return True


def keep_freed_memory(growth: float = GROWTH) -> FreedMemory | None:
    """Make this process keep freed memory for the next step (see module doc).

    Process-wide and for the allocations made after the call: call it once, before training.
    Returns the policy, whose :meth:`FreedMemory.after_step` the training loop calls each step
    (:class:`poise.Session` does both for a model on the CPU), or None where the C library is
    not glibc and nothing changed.

    Raises:
        ValueError: ``growth`` is not a number > 1.
    """
    if not growth > 1.0:
        raise ValueError(f"growth={growth!r} must be > 1: the resident memory allowed over its reference, as a ratio")
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have no mallopt of these
    except (OSError, AttributeError):
        log.info("not glibc: freed memory is left to the C library's own policy")
        return None
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX)):
        log.warning("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD: freed memory is left to glibc's policy")
        return None
    return FreedMemory(libc, growth)
