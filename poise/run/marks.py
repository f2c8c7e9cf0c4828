"""A training step's clock marks, turned into its :class:`~poise.diagnostics.timeline.StepRecord`.

Kept apart from the clocks (``clock.py``: what a mark is) and the timeline (``timeline.py``:
where records go): this is the arithmetic from marks to the seconds a record holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from poise.comm.probe import comm_overlap
from poise.diagnostics.timeline import StepRecord


@dataclass
class StepMarks:
    """One rank's step as clock marks and counts, until its figures are read.

    The session marks the points of a step as it runs (forward starts, backward starts and
    returns, the step ends; the probe adds when each bucket was handed over and reduced).
    :meth:`record` turns them into a :class:`StepRecord` in seconds. With CUDA events that
    waits for the device, so the session reads a step's marks one step later.
    """

    index: int
    start_time_s: float
    data_s: float
    forward: Any
    indices: np.ndarray
    samples: int
    tokens: int
    padded_tokens: int
    backward: Any = None
    backward_end: Any = None
    ready: Any = None
    end: Any = None
    synced: Any = None  # when the strategy's end_step began (an outer step's communication follows)
    in_flight: list[tuple[Any, Any]] = field(default_factory=list)
    loss: torch.Tensor | None = None
    skipped: bool = False
    raw_bytes: int = 0
    wire_bytes: int = 0
    inter_node_raw_bytes: int = 0
    inter_node_wire_bytes: int = 0
    codec_s: float = 0.0
    cpu_s: float = float("nan")  # CPU seconds of the rank's process in the step (StepRecord.cpu_s)
    compute_cpu_s: float = float("nan")  # ... of its training thread in forward and backward
    compute_wall_s: float | None = None  # wall seconds of its compute (None: the forward and backward marks')
    # seconds poise's emulated slowness (--rank-speed, speed noise: sleeping) slept in that compute,
    # left out of compute_wall_s: it stands for a slower chip, not for a thread waiting for a core
    emulated_s: float = 0.0

    def record(self, clock: Any) -> StepRecord:
        """The step's :class:`StepRecord` (seconds); reads the marks (waits for CUDA events)."""
        def s(mark: Any) -> float:
            return clock.seconds(self.forward, mark)

        # No bucket reached the hook only if nothing needs a gradient; then there was no comm.
        ready = self.ready if self.ready is not None else self.backward_end
        busy, hidden = comm_overlap([(s(a), s(b)) for a, b in self.in_flight], s(ready))
        end = s(self.end)
        synced = s(self.synced) if self.synced is not None else end  # an outer step waits from here on
        return StepRecord(
            step=self.index, start_time_s=self.start_time_s, data_s=self.data_s,
            forward_s=s(self.backward), backward_s=s(ready) - s(self.backward),
            comm_wait_s=s(self.backward_end) - s(ready) + end - synced, optim_s=synced - s(self.backward_end),
            step_s=self.data_s + end,
            samples=self.samples, tokens=self.tokens, padded_tokens=self.padded_tokens,
            loss=float(self.loss) if self.loss is not None else float("nan"),
            raw_bytes=self.raw_bytes, wire_bytes=self.wire_bytes, inter_node_raw_bytes=self.inter_node_raw_bytes,
            inter_node_wire_bytes=self.inter_node_wire_bytes, codec_s=self.codec_s, comm_busy_s=busy,
            comm_hidden_s=hidden, skipped=int(self.skipped), cpu_s=self.cpu_s, compute_cpu_s=self.compute_cpu_s,
            compute_wall_s=(self.compute_wall_s if self.compute_wall_s is not None else s(ready)) - self.emulated_s,
        )
