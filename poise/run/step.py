"""One training step of a :class:`poise.Session`: :class:`Step`, and :class:`DeadlineStep` under
``straggler`` (micro-batches until the shared deadline, see :mod:`poise.straggler.steps`).

Kept apart from the session (what lives across steps) so each file holds one concept. A step
reaches its session only through the instance it is given (typed ``Any`` here: the session
module imports this one, never the other way round).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from types import TracebackType
from typing import Any

import numpy as np
import torch

from poise.run.marks import StepMarks
from poise.sync.deadline import StepPlan, zero_backward


class Step:
    """One training step of one rank, open from :meth:`Session.step` until :meth:`end`.

    Attributes:
        index: steps (micro-batches) before this one in the run.
        epoch, position: where this step sits in the data plan.
        indices: this rank's sample indices for the step.
        weight: the factor :meth:`backward` multiplies the loss by (exact weighting, divided
            by ``accum_steps``).
        sync: whether gradients are reduced in this step (step your optimizer only then).
        skipped: set it True when you skipped the optimizer step (reported as such).
        loss: the loss given to :meth:`backward` (a detached tensor), or None.
    """

    def __init__(self, session: Any, *, index: int, epoch: int, position: int, indices: np.ndarray,
                 weight: float, sync: bool) -> None:
        self.session = session
        self.index, self.epoch, self.position = index, epoch, position
        self.indices, self.weight, self.sync = indices, weight, sync
        self.skipped = False
        self.loss: torch.Tensor | None = None
        self._no_sync: Any = None
        self._marks: StepMarks | None = None
        self._cpu_from = self._thread_cpu_from = 0.0  # process and thread CPU seconds where the step began

    @property
    def backward_done(self) -> bool:
        """Whether :meth:`backward` ran in this step."""
        return self._marks is not None and self._marks.backward_end is not None

    def _open(self, data_s: float) -> None:
        s = self.session
        s._active = self
        s.probe.reset()
        s.comm_state.reset_step()
        s.slowdown.begin_step(self.index)
        s.slowdown.mark_s = time.perf_counter()
        if not self.sync:
            # DDP's no_sync must cover the forward too: it arms (or not) the reduction there.
            self._no_sync = s.model.no_sync()
            self._no_sync.__enter__()
        # CPU since the previous step ended (its data loading included), or from here for the first
        self._cpu_from = s._last_exit_cpu_s if s._last_exit_cpu_s is not None else time.process_time()
        self._thread_cpu_from = time.thread_time()
        lengths = s.lengths[self.indices]
        self._marks = StepMarks(index=self.index, start_time_s=time.time(), data_s=data_s, forward=s.clock.mark(),
                             indices=self.indices, samples=len(lengths), tokens=int(lengths.sum()),
                             padded_tokens=int(len(lengths) * lengths.max()) if len(lengths) else 0)

    def __enter__(self) -> Step:
        return self

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Weight ``loss`` (the mean over this rank's batch) and run backward; gradients are
        communicated here. ``backward``: your own backward call (``accelerator.backward``),
        given the weighted loss; default: the session's ``backward``, else ``loss.backward()``.

        Raises:
            ValueError: after the step ended, or a second time in one step.
        """
        s, m = self.session, self._marks
        if m is None or s._active is not self:
            raise ValueError(f"step.backward() on step {self.index}, which has ended: open one with session.step()")
        if m.backward is not None:
            raise ValueError(f"step.backward() called twice in step {self.index}: once per step")
        s.slowdown.stretch()  # emulated slowness of the forward counts as this rank's compute
        m.backward = s.clock.mark()
        weighted = loss * self.weight
        run = backward or s.backward
        if run is None:
            weighted.backward()
        else:
            run(weighted)
        m.backward_end = s.clock.mark()
        m.compute_cpu_s = time.thread_time() - self._thread_cpu_from  # the forward since the step opened, and backward
        m.ready = s.probe.last_ready
        m.in_flight = list(s.probe.in_flight)
        self.loss = loss.detach()

    def end(self) -> None:
        """Close the step (after your optimizer step) and record it.

        Raises:
            ValueError: when the step is not open, or no :meth:`backward` ran in it (a plain
                ``loss.backward()`` would leave the loss unweighted and the step untimed).
        """
        s, m = self.session, self._marks
        if m is None or s._active is not self:
            raise ValueError(f"step {self.index} is not open: end() once per session.step()")
        self._leave_no_sync()
        s._active = None
        if m.backward is None:
            what = (f"{s.probe.buckets_this_step} gradient buckets were reduced, so backward ran outside it: "
                    "call step.backward(loss), not loss.backward(), so the loss is weighted and timed"
                    if s.probe.buckets_this_step else "no backward ran")
            raise ValueError(f"step {self.index} ended without step.backward(loss): {what}")
        m.end = s.clock.mark()
        m.cpu_s = time.process_time() - self._cpu_from
        m.emulated_s = s.slowdown.slept_s
        stats, inter = s.comm_state.step_stats(), s.comm_state.inter_node_stats()
        m.loss, m.skipped = self.loss, self.skipped
        m.raw_bytes, m.wire_bytes = stats.raw_bytes, stats.wire_bytes
        m.inter_node_raw_bytes, m.inter_node_wire_bytes = inter.raw_bytes, inter.wire_bytes
        m.codec_s = stats.encode_s + stats.decode_s
        s._close_step(m)

    def abort(self) -> None:
        """Close the step without recording it (an error interrupted it)."""
        self._leave_no_sync()
        if self.session._active is self:
            self.session._active = None

    def _leave_no_sync(self) -> None:
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.end()


class DeadlineStep(Step):
    """A step under ``straggler`` (see :mod:`poise.straggler.steps`): micro-batches until the
    shared deadline, one :meth:`backward` each; the reduction is the exact mean over the loss
    terms every rank actually computed.

    Attributes (besides :class:`Step`'s):
        plan: the step's queues, deadline and counts (:class:`~poise.straggler.steps.StepPlan`).
        trained: this rank's sample indices trained in the step (after :meth:`end`).
        empty: no rank computed anything (skip the optimizer step: the gradient is zero).
    """

    def __init__(self, session: Any, *, plan: StepPlan, index: int, epoch: int, position: int,
                 indices: np.ndarray) -> None:
        super().__init__(session, index=index, epoch=epoch, position=position, indices=indices, weight=0.0, sync=True)
        self.plan = plan
        self.trained = np.zeros(0, dtype=np.int64)
        self.empty = False
        self._loss_sum: torch.Tensor | None = None
        self._terms = 0.0
        self._micro: Generator[Any, None, None] | None = None

    def micro_batches(self, load: Callable[[np.ndarray], Any]) -> Iterator[Any]:
        """This rank's micro-batches until the deadline, each loaded by ``load(indices)``."""
        runner = self.session.deadline
        assert runner is not None
        self._micro = runner.micro_batches(self.plan, load, self._arm, self._zero_reduce)
        return self._micro

    def _close_micro(self) -> None:
        """Close the micro-batch loop if it was left early: it holds the step's lock and watchdog."""
        if self._micro is not None:
            self._micro.close()
            self._micro = None

    def _arm(self, last: bool) -> None:
        """Before a micro-batch's forward: DDP reduces in its backward only when it is the last."""
        if last:
            self._leave_no_sync()
        elif self._no_sync is None:
            self._no_sync = self.session.model.no_sync()
            self._no_sync.__enter__()

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Weight ``loss`` (the mean over the micro-batch just handed out) and run backward."""
        s, m, plan = self.session, self._marks, self.plan
        runner = s.deadline
        assert runner is not None
        if m is None or s._active is not self:
            raise ValueError(f"step.backward() on step {self.index}, which has ended")
        if plan.current is None or plan.backwards != plan.computed:
            raise ValueError(f"step.backward() in step {self.index}: once per micro-batch handed out by "
                             "micro_batches, inside its loop")
        plan.backwards += 1
        s.slowdown.stretch()
        terms = runner.terms_of(plan.current)
        weighted = loss * (s.world_size * terms / plan.reference)
        if plan.last:
            m.backward = s.clock.mark()
            runner.begin_reduce(plan, plan.current)
        run = backward or s.backward
        if run is None:
            weighted.backward()
        else:
            run(weighted)
        if plan.last:
            self._reduced(m)
        detached = loss.detach() * terms
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._terms += terms

    def _zero_reduce(self) -> None:
        s, m = self.session, self._marks
        assert m is not None and s.deadline is not None
        m.backward = s.clock.mark()
        s.deadline.begin_reduce(self.plan, None)
        zero_backward(s.model)
        self._reduced(m)

    def _reduced(self, m: StepMarks) -> None:
        s = self.session
        assert s.deadline is not None
        m.backward_end = s.clock.mark()
        m.ready = s.probe.last_ready
        m.in_flight = list(s.probe.in_flight)
        s.deadline.end_reduce(self.plan, s.model)

    def end(self) -> None:
        """Close the step (after your optimizer step): the pool and the record."""
        s, m = self.session, self._marks
        if m is None or s._active is not self:
            raise ValueError(f"step {self.index} is not open: end() once per step")
        assert s.deadline is not None
        self._close_micro()
        if self.plan.current is not None:
            raise ValueError(f"step {self.index}: the micro-batch loop was left between a micro-batch and its "
                             "step.backward(loss): that micro-batch is claimed and would be lost; leave the "
                             "loop after a backward")
        if not self.plan.reduced:  # the micro-batch loop was left early: join the reduction now
            self._arm(True)
            self._zero_reduce()
        self.trained = s.deadline.finish_step(self.plan, sampler_step=self.position >= 0)
        self.empty = self.plan.total_terms == 0
        lengths = s.lengths[self.trained]
        m.indices, m.samples, m.tokens = self.trained, len(lengths), int(lengths.sum())
        m.padded_tokens = int(len(lengths) * lengths.max()) if len(lengths) else 0
        self.loss = self._loss_sum / self._terms if self._loss_sum is not None and self._terms else None
        m.compute_cpu_s, m.compute_wall_s = self.plan.compute_cpu_s, self.plan.compute_wall_s
        self.skipped = self.skipped or self.empty
        super().end()

    def abort(self) -> None:
        """Close the step without recording it (an error interrupted it)."""
        self._close_micro()
        super().abort()


__all__ = ["DeadlineStep", "Step"]
