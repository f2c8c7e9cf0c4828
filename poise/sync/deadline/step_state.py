"""One rank's view of one deadline step: its queues, deadline and counts, as the step runs.

Made by :meth:`poise.sync.deadline.runner.DeadlineRunner.plan_step`, filled in by the
micro-batch loop, the watchdog and the count (see the runner's module doc for the algorithm).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from poise.straggler.queues import Queues


@dataclass
class StepPlan:
    """One rank's view of one deadline step (made by :meth:`DeadlineRunner.plan_step`)."""

    index: int
    queues: Queues
    deadline_s: float | None  # seconds after the step's start; None: wait for everyone
    reference: float  # planned loss terms over all ranks (the weights divide by it)
    started_s: float = 0.0  # perf_counter() at the step's start
    gap_s: float = -1.0  # seconds from the previous reduction's end to started_s (-1: no previous)
    computed: int = 0  # micro-batches this rank computed
    terms: float = 0.0  # loss terms this rank computed
    last: bool = False  # the current micro-batch is this rank's last (its backward reduces)
    reduced: bool = False  # the count all-reduce was started (the gradient reduction is under way)
    settled: bool = False  # the reduction and the count are done
    stale: bool = False  # this rank replays its previous gradient
    taken: np.ndarray = field(default_factory=lambda: np.zeros(0))  # this rank's micro-batches from each list
    taken_all: np.ndarray = field(default_factory=lambda: np.zeros(0))  # every rank's, from each list (agreed)
    mine: list[np.ndarray] = field(default_factory=list)  # the micro-batches this rank computed
    total_terms: float = 0.0  # loss terms computed over all ranks
    work: Any = None
    vector: torch.Tensor | None = None
    stall_s: float = 0.0  # delays injected on this rank in this step
    compute_cpu_s: float = 0.0  # CPU seconds of this rank's thread in its micro-batches' forward and backward
    compute_wall_s: float = 0.0  # wall seconds of the same spans
    current: np.ndarray | None = None  # the micro-batch handed out last
    backwards: int = 0  # backward calls of the step (one per micro-batch)
    joined_late: bool = False  # the watchdog entered the reduction for this rank while it stalled
    stalling: bool = False  # this rank is in an injected delay (its lock released)
    done: bool = False  # this rank left its micro-batch loop (the watchdog has nothing left to do)
    wake: threading.Event = field(default_factory=threading.Event)  # set when stalling or done changes
    error: BaseException | None = None  # what the watchdog's reduction raised


__all__ = ["StepPlan"]
