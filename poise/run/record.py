"""What a session keeps of its steps: the open one, the records, the evaluations, the report.

:class:`Recorder` is the owner a :class:`~poise.run.step.Step` reports to
(:class:`~poise.run.step.StepOwner`): it holds the open step, turns each closed step's marks
into a :class:`~poise.diagnostics.timeline.StepRecord` (one step late on CUDA, where reading
events waits for the device), feeds the timeline, the codec trial and the re-planner, and
lets the strategy run its work between steps. At the end, :func:`write_report` gathers every
rank's figures and writes the outputs on rank 0.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch.distributed as dist

from poise.balance.rebalance import DynamicPartitioner
from poise.balance.replay import ReplayedPartitioner
from poise.balance.speeds import window_terms
from poise.comm.trial import CodecTrial
from poise.diagnostics import report as report_mod
from poise.diagnostics.timeline import StepRecord, Timeline
from poise.run.marks import StepMarks
from poise.run.step import Step
from poise.runtime import memory
from poise.runtime.clock import Clock, HostClock
from poise.sync import Sync

T = TypeVar("T")


@dataclass
class Progress:
    """What the check for a forgotten ``finish()`` reads of a recorder (:func:`warn_unfinished`),
    kept apart so the check holds no reference to the recorder, its model or its session."""

    steps_done: int = 0
    finished: bool = False


class Recorder:
    """The open step and the record of closed ones, for one rank (see module doc).

    Args:
        clock: what marks are (records of CUDA events are read one step late).
        timeline: where records go (gathered to rank 0).
        lengths: per-sample size (the re-planner's window terms).
        sync: the strategy, asked for its work between steps.
        partitioner: the re-planner (balance ``dynamic``), or None.
        trial: ``comm.codec=auto``'s trial, fed every record, or None.
        freed_memory: the kept-memory policy, told after every step, or None.
        last_step: the run's last step in micro-batches, if known (no re-plan after it).
    """

    def __init__(self, *, clock: Clock, timeline: Timeline, lengths: np.ndarray, sync: Sync,
                 partitioner: DynamicPartitioner | ReplayedPartitioner | None, trial: CodecTrial | None,
                 freed_memory: memory.FreedMemory | None, last_step: int | None) -> None:
        self.clock, self.timeline, self.lengths, self.sync = clock, timeline, lengths, sync
        self.partitioner, self.trial, self.freed_memory, self.last_step = partitioner, trial, freed_memory, last_step
        self.active: Step | None = None
        self.progress = Progress()  # steps recorded, report written: what the exit check reads
        self.last_record: StepRecord | None = None
        self.pending: deque[StepMarks] = deque()
        self.lag = 0 if isinstance(clock, HostClock) else 1  # CUDA: read a step's events one step later
        self.last_exit_s: float | None = None
        self.last_exit_cpu_s: float | None = None  # time.process_time() then: a step's CPU counts from there
        self.clock_s: float | None = None  # when the first step opened: training time counts from there
        self.eval_s = 0.0  # seconds spent in evaluations, left out of the training time
        self.eval_curve: list[dict[str, float]] = []
        # a resumed step's strategy end (Step.sync_end's arguments), run before the next step or the report
        self.due_end: dict[str, Any] | None = None

    @property
    def steps_done(self) -> int:
        """Steps (micro-batches) recorded, over all epochs (resumed ones included)."""
        return self.progress.steps_done

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self.progress.steps_done = value

    @property
    def finished(self) -> bool:
        """Whether the report was written (:func:`write_report` ran)."""
        return self.progress.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self.progress.finished = value

    # -- the open step (StepOwner) -----------------------------------------------------------

    def is_open(self, step: Step) -> bool:
        return self.active is step

    def opened(self, step: Step) -> float | None:
        if self.active is not None:
            raise ValueError("a step was opened while another step is open: one step at a time")
        self.end_saved_step()
        self.active = step
        if self.clock_s is None:
            self.clock_s = time.perf_counter()
        return self.last_exit_cpu_s

    def end_saved_step(self) -> None:
        """Run the strategy's end of the step a resumed state was saved inside (after its
        optimizer step, before it ended), once, on every rank: the outer step due there, so
        the resumed run continues exactly where the saved one would have."""
        due, self.due_end = self.due_end, None
        if due is not None:
            self.sync.end_step(due["index"], tokens=due["tokens"], optimizer_step=due["optimizer_step"])

    def aborted(self, step: Step) -> None:
        if self.active is step:
            self.active = None

    def closed(self, step: Step, marks: StepMarks) -> None:
        self.active = None
        self.last_exit_s, self.last_exit_cpu_s = time.perf_counter(), time.process_time()
        self.pending.append(marks)
        self.steps_done += 1
        if self.freed_memory is not None:
            self.freed_memory.after_step()
        while len(self.pending) > self.lag:
            self._take(self.pending.popleft())
        if self.sync.between_steps():  # auto's dry run: no step's seconds
            self.last_exit_s, self.last_exit_cpu_s = time.perf_counter(), time.process_time()
        if self.partitioner is not None:
            self.partitioner.after_step(self.steps_done - len(self.pending), self.steps_done, self.last_step)

    def data_s(self, handed_s: float) -> float:
        """Data seconds of a step whose batch was asked of the sampler at ``handed_s``: since
        then, or since the last step ended if it was prefetched before that."""
        since = max(handed_s, self.last_exit_s) if self.last_exit_s is not None else handed_s
        return max(0.0, time.perf_counter() - since)

    def _take(self, marks: StepMarks) -> None:
        rec = marks.record(self.clock)
        self.timeline.record(rec)
        if self.trial is not None:
            self.trial.observe(rec.step, rec.step_s, rec.comm_wait_s)
        if self.partitioner is not None:
            self.partitioner.observe(self.lengths[marks.indices], rec.compute_s)
        self.last_record = rec

    def drain(self) -> None:
        """Read every pending record (waits for CUDA events)."""
        while self.pending:
            self._take(self.pending.popleft())

    def pending_window(self) -> list[tuple[float, float, float]]:
        """The re-planner's window terms of the steps not yet read (for a checkpoint)."""
        if self.partitioner is None:
            return [window_terms(self.lengths[m.indices], m.record(self.clock).compute_s) for m in self.pending]
        terms = self.partitioner.sampler.cost_terms  # a packed sampler's are its rows'
        return [(*terms(self.lengths[m.indices]), m.record(self.clock).compute_s) for m in self.pending]

    # -- evaluations -------------------------------------------------------------------------

    def evaluate(self, fn: Callable[[], T], optimizer_step: int) -> T:
        """Run ``fn`` between steps and record its loss against the training seconds so far
        (see :meth:`poise.Session.evaluate`)."""
        if self.active is not None:
            raise ValueError("session.evaluate() inside an open step: evaluate between steps")
        start = time.perf_counter()
        train_s = start - self.clock_s - self.eval_s if self.clock_s is not None else 0.0
        result = fn()
        self.eval_s += time.perf_counter() - start
        loss = result if isinstance(result, (int, float)) else getattr(result, "loss", None)
        if not isinstance(loss, (int, float)):
            raise ValueError(f"session.evaluate(): fn returned {type(result).__name__}, which is neither a number "
                             "nor has a numeric .loss")
        self.eval_curve.append({"step": optimizer_step, "train_s": train_s, "loss": float(loss)})
        return result


def run_keys(recorder: Recorder, ranks: list[dict[str, Any]], *, compression_start: int,
             trial: CodecTrial | None, partitioner: DynamicPartitioner | ReplayedPartitioner | None) -> dict[str, Any]:
    """The report's keys about how the run went, from every rank's gathered figures (rank 0)."""
    return {
        "compression_start_step": compression_start,  # optimizer steps sent uncompressed first
        "codec_trial": trial.summary() if trial else None,
        "replans": [e.__dict__ for e in partitioner.history] if partitioner else [],
        # rank 0's seconds in re-plans: all of it (the all-gather and its wait for the last rank
        # to end its step included), and deciding alone (what no step would otherwise spend)
        "replan_s": getattr(partitioner, "spent_s", 0.0) if partitioner else 0.0,
        "replan_decide_s": getattr(partitioner, "decide_s", 0.0) if partitioner else 0.0,
        "straggler": [d.pop("straggler") for d in ranks],  # per rank; None: off
        "memory": [d.pop("memory") for d in ranks],  # per rank: policy, resident MB, state (poise/runtime/memory.py)
        "emulated_slowdown": ranks,  # speed 1.0, method 'none' = not slowed
        "eval_curve": recorder.eval_curve,  # rank 0's evaluate() calls: step, train_s (s), loss
    }


def write_report(recorder: Recorder, *, rank: int, world_size: int, per_rank: dict[str, Any],
                 make_report: Callable[[list[dict[str, Any]], Any], dict[str, Any]], out_dir: Path | None,
                 plot: bool) -> dict[str, Any] | None:
    """Gather ``per_rank`` figures from every rank and, on rank 0, the report ``make_report``
    builds from them and the gathered timeline's table, written into ``out_dir`` if set. A
    collective; every rank returns once the outputs are on disk (so no rank tears the process
    group down while rank 0 still writes). Returns the report on rank 0, None elsewhere.

    Raises:
        RuntimeError: on the other ranks, when rank 0 could not write (rank 0 re-raises its error).
    """
    recorder.drain()
    recorder.timeline.flush()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, per_rank)
    report, failure, error = None, [None], None
    if rank == 0:
        try:
            table = recorder.timeline.table()
            report = make_report(gathered, table)
            if out_dir is not None:
                report_mod.write_outputs(out_dir, report, table, plot=plot)
        except Exception as exc:  # the other ranks must hear of it, not wait for a collective
            failure[0], error = f"{type(exc).__name__}: {exc}", exc
    dist.broadcast_object_list(failure, src=0)
    if error is not None:
        raise error
    if failure[0] is not None:
        raise RuntimeError(f"rank 0 could not write the run's outputs: {failure[0]}")
    # the broadcast's source returns as soon as it has sent: without this, rank 0 can tear
    # its process group down while a peer still reads (gloo then aborted one run in CI)
    dist.barrier()
    recorder.finished = True
    return report


def warn_unfinished(progress: Progress, rank: int) -> None:
    """When a session's recorder is collected (the session went out of scope, e.g. at the end
    of the ``main()`` that made it), or at exit if it never was (``weakref.finalize``): say so
    when steps were trained but no report was written (``session.finish()`` never ran), so
    the run does not pass for a finished one."""
    if not progress.finished and progress.steps_done and rank == 0:
        sys.stderr.write(f"poise: {progress.steps_done} steps were trained but session.finish() was never called: "
                         "no report.json was written (call it on every rank after the last step)\n")


__all__ = ["Progress", "Recorder", "run_keys", "warn_unfinished", "write_report"]
