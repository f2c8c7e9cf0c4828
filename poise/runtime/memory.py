"""Keeping the memory one training step frees for the next one (glibc's malloc, CPU tensors).

Why: glibc serves every allocation over its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh ``mmap`` and unmaps it on free, so a CPU training step pays a page fault
for every 4 KiB page of its large activations, every step: code-lm's model, 60 steps of varied
shapes, took 5.1 million page faults, against 0.65 million with the memory kept (two processes
side by side on this 2-core machine; an ad hoc script). The cost is not only noise but a bias.
The rank with the larger share has more of its tensors over the threshold: on the fifth of the steps
with the most tokens, the full-speed rank of ``poise bench balance``'s run c ran 3-16 % slower
per cost unit, relative to its half-speed peer, than on the other steps (12 runs,
``runs/s40-*-c-*`` and ``runs/s41-plain-c-*``), and the dynamic balancer cannot plan for a
cost that depends on the step's size. With the memory kept (the same runs under
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0``, interleaved with plain ones,
``runs/s41-nommap-c-*``), that bias vanished and the balance once converged read 0.970
against 0.950 (medians of 6); with this module, 0.957 (``poise bench balance --runs c,e,f
--repeats 3``, ``runs/s41-cef3``, median of 3).

What: ``mallopt(M_MMAP_MAX, 0)`` (no allocation is served by ``mmap``) and the largest trim
threshold (the heap's free top is not given back), so a step reuses the pages of the last one.
PyTorch's CUDA caching allocator makes the same trade on the GPU. The price is fragmentation:
freed holes that a later, differently shaped tensor does not fit. In one process of 150 steps
of varied code-lm shapes the heap held 3.2 GB for 0.14 GB in use between steps, and resident
memory kept growing (4.4 GB against glibc's own 2.1 GB). So :meth:`FreedMemory.after_step`
bounds it: past ``limit_bytes`` of resident memory it calls ``malloc_trim(0)``, which gives
every free page back (the next steps fault them in once more). The default limit is half of the
machine's memory (or of the cgroup's limit, where lower) divided among ``LOCAL_WORLD_SIZE``
workers: memory to spare is kept, memory that other workers or the page cache need is not.
DataLoader workers forked later inherit the setting without the bound; their batches go to
shared memory, not to their heap. A first version compared with twice the resident size of the first
five steps; code-lm's first steps are small ones, so rank 0 trimmed 7 times in 150 steps and
paid the faults again (balance 0.928 in its one run).

Only glibc (Linux) has these knobs; elsewhere :func:`keep_freed_memory` changes nothing and
says so (returns None).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes an int: the largest trim threshold it can set (2 GiB)
LIMIT_SHARE = 0.5  # of this worker's share of the machine's (or cgroup's) memory


def resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes() -> int:
    """This process's peak resident memory so far in bytes (its high-water mark, ``getrusage``;
    Linux counts kilobytes), 0 where it cannot be read."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError, ValueError):
        return 0


def state_bytes(module: Any, optimizer: Any = None) -> int:
    """Bytes of the training state this rank holds: ``module``'s parameters and their gradients,
    and ``optimizer``'s state tensors (Adam's moments), each counted by its local part (a
    sharded parameter, a ``DTensor``, by its shard). What data parallelism replicates and
    sharding divides, unlike the resident memory, which also holds Python, torch and activations."""
    def local(tensor: Any) -> int:
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return int(tensor.numel()) * int(tensor.element_size())

    total = 0
    for param in module.parameters():
        total += local(param)
        if param.grad is not None:
            total += local(param.grad)
    if optimizer is not None:
        for per_param in optimizer.state.values():
            total += sum(local(v) for v in per_param.values() if hasattr(v, "element_size") and v.dim() > 0)
    return total


def memory_limit_bytes() -> int:
    """The memory this process's machine or cgroup allows, in bytes: the smaller of physical
    memory and the cgroup's limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``)."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def default_limit_bytes() -> int:
    """Half of this worker's share of :func:`memory_limit_bytes` (``LOCAL_WORLD_SIZE`` workers)."""
    try:
        workers = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        workers = 1
    return int(LIMIT_SHARE * memory_limit_bytes() / workers)


@dataclass
class FreedMemory:
    """The installed policy (see module doc): call :meth:`after_step` once per training step.

    Attributes:
        limit_bytes: resident memory, in bytes, past which free pages are given back.
        trims: how many times they were.
    """

    libc: ctypes.CDLL = field(repr=False)
    limit_bytes: int
    trims: int = 0

    def after_step(self) -> bool:
        """Give free pages back when resident memory passed the limit; returns whether it did.

        One read of ``/proc/self/statm`` per call (microseconds)."""
        rss = resident_bytes()
        if rss <= self.limit_bytes:
            return False
        self.libc.malloc_trim(0)
        self.trims += 1
        log.info("resident memory %.0f MB over the limit of %.0f MB: free pages given back, now %.0f MB",
                 rss / 1e6, self.limit_bytes / 1e6, resident_bytes() / 1e6)
        return True


def summary(kept: FreedMemory | None, state: int | None = None) -> dict[str, object]:
    """One rank's memory for the report: the policy (kept or not, trims), resident MB now and at
    its peak, and ``state`` (bytes of :func:`state_bytes`, if known) in MB."""
    return {"kept": kept is not None, "trims": kept.trims if kept else 0,
            "resident_mb": round(resident_bytes() / 1e6, 1),
            # getrusage and /proc count a little differently: the peak is never below the present
            "peak_resident_mb": round(max(peak_resident_bytes(), resident_bytes()) / 1e6, 1),
            "model_state_mb": None if state is None else round(state / 1e6, 3)}


def keep_freed_memory(limit_bytes: int | None = None) -> FreedMemory | None:
    """Make this process keep freed memory for the next step (see module doc).

    Process-wide and for the allocations made after the call: call it once, before training.
    Returns the policy, whose :meth:`FreedMemory.after_step` the training loop calls each step
    (:class:`poise.Session` does both for a model on the CPU), or None where the C library is
    not glibc and nothing changed.

    Args:
        limit_bytes: resident memory past which free pages are given back; default
            :func:`default_limit_bytes`.

    Raises:
        ValueError: ``limit_bytes`` is not a positive integer.
    """
    limit = default_limit_bytes() if limit_bytes is None else limit_bytes
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        raise ValueError(f"limit_bytes={limit_bytes!r} must be a positive number of bytes")
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl and macOS have no mallopt of these
    except (OSError, AttributeError):
        log.info("not glibc: freed memory is left to the C library's own policy")
        return None
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, _INT_MAX)):
        log.warning("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD: freed memory is left to glibc's policy")
        return None
    return FreedMemory(libc, limit)
