"""Clocks for timing a training step without serialising what is measured.

A step is timed by *marks*: points in its execution (forward starts, the last gradient
bucket is ready, backward returns, ...). On the CPU a mark is ``time.perf_counter()``, read
when the host gets there, which is when the work is done. On CUDA, kernels run
asynchronously: the host reaches a point long before the device does, so a host clock would
time kernel launches. Synchronising the device at every mark would fix the figure and break
the thing measured: a ``torch.cuda.synchronize()`` in a gradient bucket's hook stalls the
queue behind it, so communication can no longer overlap backward compute. A CUDA mark is
instead an event recorded on the current stream; the device stamps it when it gets there,
and the step's figures are read once every mark is done (after the step, see
:meth:`Clock.ready`), never in the hot path.

Both clocks give seconds between two of their marks; a mark from one clock is meaningless
to the other.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


class Clock(Protocol):
    """Marks points of a step and turns pairs of marks into seconds."""

    def mark(self) -> Any:
        """A mark for "now" on this clock (for CUDA: now in the current stream's order)."""
        ...

    def ready(self, mark: Any) -> bool:
        """Whether ``mark`` has been reached (always True for the host clock)."""
        ...

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end``; both must be :meth:`ready` (waits otherwise)."""
        ...


class HostClock:
    """``time.perf_counter()``: right wherever the host's progress is the work's progress (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark: float) -> bool:
        return True

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    """CUDA events with timing, recorded on the current stream of ``device``.

    A mark taken inside a comm hook's future callback is recorded on the stream the callback
    runs on, which waits for the collective: so it stamps the collective's completion.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, mark: torch.cuda.Event) -> bool:
        return bool(mark.query())

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()  # a CPU/GPU synchronisation point: only when figures are read, after the step
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def clock_for(device: torch.device) -> Clock:
    """The clock that times work on ``device`` honestly: CUDA events on a GPU, the host clock elsewhere."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
