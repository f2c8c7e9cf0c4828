"""The loop of deadline steps behind ``session.steps(loader)`` (``straggler`` on, or delays
emulated): a :class:`~poise.run.step.DeadlineStep` for each planned step of the epoch, then
catch-up steps for the samples the deadline deferred, until every rank agrees the pool is empty.

Why the micro-batches are loaded here, from ``loader.dataset`` with ``loader.collate_fn``, in
this process: a DataLoader's workers would load samples the deadline may not reach (those go
back into the epoch's plan, :mod:`poise.sync.deadline`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from poise.run.data import Sampler
from poise.run.record import Recorder
from poise.run.step import DeadlineStep, Step, StepEnv
from poise.sync import Deadline

# how a session hands a step and its item to the loop, and ends the step when the loop comes back
HandOut = Callable[[Step, Any], Iterator[tuple[Any, Any]]]


@dataclass
class DeadlineLoop:
    """The deadline steps of one epoch, opened on this rank (see module doc).

    Attributes:
        env: what each step needs (its ``sync`` is the :class:`~poise.sync.Deadline` strategy).
        sampler: the session's sampler (this rank's batch of each planned step).
        recorder: keeps the open step and counts the steps done.
        rank: this rank in the process group.
    """

    env: StepEnv
    sampler: Sampler
    recorder: Recorder
    rank: int

    @property
    def deadline(self) -> Deadline:
        assert isinstance(self.env.sync, Deadline)
        return self.env.sync

    def steps(self, loader: Any, hand_out: HandOut) -> Iterator[tuple[DeadlineStep, Iterator[Any]]]:
        """``(step, micro_batches)`` for each planned step, then for each catch-up step, each
        handed to the loop by ``hand_out``."""
        dataset, collate = loader.dataset, loader.collate_fn

        def load(indices: np.ndarray) -> Any:
            return collate([dataset[int(i)] for i in indices])

        for _ in self.sampler:  # this rank's batch of each planned step; its micro-batches are loaded in the step
            step = self.open_step(catch_up=False)
            yield from hand_out(step, step.micro_batches(load))
        while len(self.deadline.runner.pool):  # the epoch's deferred samples, every rank agreeing on the pool
            step = self.open_step(catch_up=True)
            yield from hand_out(step, step.micro_batches(load))

    def open_step(self, catch_up: bool) -> DeadlineStep:
        """Open the next deadline step: the batch the sampler just handed out, or (``catch_up``)
        samples from the pool of deferred ones; its deadline clock starts now."""
        if self.recorder.active is not None:
            raise ValueError("a deadline step while another step is open")
        if catch_up:
            epoch, position, handed_s, batches = self.sampler.epoch, -1, time.perf_counter(), None
        else:
            epoch, position, handed_s = self.sampler.handed.popleft()
            batches = self.sampler.global_batches(position)
        plan = self.deadline.runner.plan_step(self.recorder.steps_done, batches)
        queue = plan.queues.micro[self.rank]
        step = DeadlineStep(self.env, plan=plan, index=self.recorder.steps_done, epoch=epoch, position=position,
                            indices=np.concatenate(queue) if queue else np.zeros(0, dtype=np.int64))
        step._open(data_s=self.recorder.data_s(handed_s))
        plan.started_s = time.perf_counter()
        return step


__all__ = ["DeadlineLoop", "HandOut"]
