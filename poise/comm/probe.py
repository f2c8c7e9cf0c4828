"""The probe that splits a rank's backward into its own compute and communication.

DDP hands each gradient bucket to a communication hook as soon as the bucket's gradients
are ready, then waits for every hook's future at the end of ``backward()``. That gives a
clean way to split backward time on each rank without extra synchronisation:

- the moment the *last* bucket reaches its hook is when this rank finished computing its
  gradients (its own compute, whatever its speed);
- the time from then until ``backward()`` returns is time blocked in communication,
  which includes waiting for slower ranks to send their share.

Timing the whole ``backward()`` instead would hide a slow rank: DDP's all-reduce makes every
rank's backward last as long as the slowest one's. :class:`BucketProbe` records a mark of its
:class:`~poise.runtime.clock.Clock` when each bucket is handed over and when its reduction
completes; :func:`instrumented` wraps any hook with it, so compression hooks and torch's own
are measured the same way. On CUDA the marks are events: nothing waits for the device in
the hook, so communication still overlaps backward (see ``poise/runtime/clock.py``).

(This module must not use ``from __future__ import annotations``: DDP inspects the hook's
annotations at registration and compares them with real classes, not strings.)
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from poise.runtime.clock import Clock, HostClock

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def comm_overlap(in_flight: Sequence[tuple[float, float]], compute_end_s: float) -> tuple[float, float]:
    """``(busy, hidden)`` seconds: how long at least one bucket was in flight (the union of the
    ``(start, end)`` intervals, in seconds on one time axis), and how much of that fell before
    ``compute_end_s`` (hidden behind backward compute)."""
    busy = hidden = 0.0
    cur_start = cur_end = None
    for start, end in sorted(in_flight):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
                hidden += max(0.0, min(cur_end, compute_end_s) - cur_start)
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
        hidden += max(0.0, min(cur_end, compute_end_s) - cur_start)
    return busy, hidden


class BucketProbe:
    """Per-step record of when this rank's gradient buckets became ready and were reduced.

    Attributes:
        clock: what the marks are (host seconds on CPU, CUDA events on a GPU).
        last_ready: mark of the moment the last bucket reached the hook this step, or None
            before any did.
        buckets_this_step: number of buckets seen this step.
        in_flight: ``(start, end)`` marks of each bucket this step, from the hook call to the
            completion of its future (collectives and decoding included).

    (Bytes are counted by the hook's own state: ``step_stats()``.)
    """

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else HostClock()
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.last_ready: Any = None
        self.buckets_this_step = 0
        self.in_flight: list[tuple[Any, Any]] = []

    def on_bucket(self) -> Any:
        """Note a bucket handed to the hook; returns its mark for :meth:`on_done`."""
        self.last_ready = self.clock.mark()
        self.buckets_this_step += 1
        return self.last_ready

    def on_done(self, started: Any) -> None:
        """Note that the bucket handed over at ``started`` is reduced (called from a future's
        callback thread; appending to a list is atomic)."""
        self.in_flight.append((started, self.clock.mark()))

    def comm_overlap(self, compute_end: Any, origin: Any = 0.0) -> tuple[float, float]:
        """:func:`comm_overlap` of this step's buckets, with marks read as seconds since
        ``origin`` (a mark of this clock taken before any bucket; any number for the host
        clock). Reads CUDA events: call after the step."""
        def s(mark: Any) -> float:
            return self.clock.seconds(origin, mark)

        return comm_overlap([(s(a), s(b)) for a, b in self.in_flight], s(compute_end))


def instrumented(hook: CommHook, probe: BucketProbe) -> CommHook:
    """Wrap a DDP comm hook so ``probe`` sees every bucket before ``hook`` sends it, and when
    its reduction completes.

    (DDP checks the wrapper's annotations at registration, so this module must not use
    postponed, string annotations.)
    """

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        started = probe.on_bucket()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            probe.on_done(started)
            return fut.value()

        return hook(state, bucket).then(done)

    return timed_hook
