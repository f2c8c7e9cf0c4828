"""The machine's CPU time while a benchmark job runs, read from ``/proc/stat``.

Why a benchmark wants it: on a machine with fewer cores than workers, a job's throughput is
the share of the cores its processes kept busy, times the cores, over the CPU time each
sample costs. The first is what scheduling controls; the second moves with the machine's own
speed (by up to 10 % within minutes on this project's 2-core machine), so reporting the two
apart tells a schedule's loss from a slow stretch of the machine (``poise bench stragglers``).
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from poise.files import write_text_atomic

PROC_STAT = Path("/proc/stat")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc/stat's unit


def _cpu_seconds() -> tuple[float, float]:
    """The machine's busy and total CPU time since boot, seconds summed over its cores
    (/proc/stat's first line: busy = user, nice, system, irq, softirq, steal; total adds idle
    and iowait)."""
    fields = [int(v) for v in PROC_STAT.read_text().split("\n", 1)[0].split()[1:9]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]
    return busy / _TICKS_PER_S, (busy + fields[3] + fields[4]) / _TICKS_PER_S


@contextmanager
def cpu_trace(path: Path, period_s: float = 0.05) -> Iterator[None]:
    """Sample the machine's CPU time every ``period_s`` seconds while the block runs, then
    write ``path``: one line ``unix_time_s busy_s total_s`` per sample (:func:`_cpu_seconds`;
    read back with :func:`cpu_use`). Nothing is written where /proc/stat does not exist.
    """
    if not PROC_STAT.exists():
        yield
        return
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while True:
            samples.append((time.time(), *_cpu_seconds()))
            if stop.wait(period_s):
                return

    thread = threading.Thread(target=sample, name="poise-cpu-trace", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        write_text_atomic(path, "".join(f"{t:.4f} {b:.2f} {a:.2f}\n" for t, b, a in samples))


def cpu_use(path: Path, start_s: float, end_s: float) -> tuple[float, float] | None:
    """From a :func:`cpu_trace` file: the share of all cores busy (0..1) and the busy CPU
    seconds between the first and last samples within ``[start_s, end_s]`` (unix seconds);
    None without the file or with fewer than two samples in the window.

    Raises:
        ValueError: the file is not such a trace (one line naming it).
    """
    text = path.read_text() if path.exists() else ""
    if not text.strip():
        return None
    try:
        table = np.loadtxt(io.StringIO(text), ndmin=2)
    except ValueError:
        table = np.zeros((0, 0))
    if table.ndim != 2 or table.shape[1] != 3 or not np.all(np.isfinite(table)) \
            or np.any(np.diff(table, axis=0) < 0):
        raise ValueError(f"{path} is not a CPU trace (lines of 'unix_time_s busy_s total_s', non-decreasing)")
    inside = table[(table[:, 0] >= start_s) & (table[:, 0] <= end_s)]
    if len(inside) < 2:
        return None
    busy, total = inside[-1, 1:] - inside[0, 1:]
    return (float(busy / total) if total > 0 else 0.0), float(busy)


__all__ = ["PROC_STAT", "cpu_trace", "cpu_use"]
