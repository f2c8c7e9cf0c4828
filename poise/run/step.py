"""One training step of a :class:`poise.Session`: :class:`Step`, and :class:`DeadlineStep` under ``straggler``
(micro-batches until the shared deadline, see :mod:`poise.sync.deadline`).

A step is given a :class:`StepEnv`, the typed few things it needs (the synchronization strategy, the clock, the
samples' lengths, the recorder that owns the open step, the listeners told when a step begins and ends), never the
session itself. It calls the strategy at its fixed points (:mod:`poise.sync.base`): ``begin_step`` and ``micro_batch``
when it opens, ``micro_batch`` again before each micro-batch of a deadline step, ``end_step`` after the optimizer
step, and reads its traffic when it closes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from poise.balance.packing import row_count
from poise.run.marks import StepMarks
from poise.run.terms import LabelCount
from poise.runtime.clock import Clock
from poise.sync import Deadline, Sync
from poise.sync.deadline import StepPlan

log = logging.getLogger(__name__)


class StepListener(Protocol):
    """Told when a step begins and ends (emulation hangs its per-step state here, from outside
    the step: ``poise/emulate/``)."""

    def step_began(self, index: int) -> None: ...

    def step_ended(self, index: int) -> None: ...

    def injected_s(self) -> float:
        """Seconds of this step that stand for a slower device (emulated sleeps), which the
        record leaves out of the rank's compute seconds."""
        ...


class StepOwner(Protocol):
    """Who keeps the open step and records closed ones (:class:`poise.run.record.Recorder`)."""

    def is_open(self, step: Step) -> bool: ...

    def opened(self, step: Step) -> float | None:
        """``step`` opens; returns ``time.process_time()`` when the previous step ended (None: none did)."""
        ...

    def closed(self, step: Step, marks: StepMarks) -> None: ...

    def aborted(self, step: Step) -> None: ...


@dataclass
class StepEnv:
    """What a step needs of its session (see module doc).

    Attributes:
        sync: the synchronization strategy (a :class:`~poise.sync.Deadline` for deadline steps).
        clock: what marks are (host seconds, or CUDA events).
        lengths: per-sample size, to count a step's tokens.
        world_size: ranks in the process group.
        owner: keeps the open step; records it when it ends.
        listeners: told when a step begins and ends.
        backward: the default way :meth:`Step.backward` runs backward (``accelerator.backward``; None:
            ``loss.backward()``). Read at each call.
        device: where small collectives' tensors live (the process group's device).
        accum_steps: micro-batches per optimizer step (a micro-batch's weight divides by it).
        labels: the loss terms counted in a Hugging Face model's forward (``labels=``), or None
            (another model: the planned ``Data.loss_terms`` weigh the step).
        planned_terms: what the planned weights assume when that may not be the loss's terms
            (``Data.loss_terms`` not given and samples of unequal lengths), said once when no
            count replaces them; None: nothing to say.
        items_agreed: whether the ranks agreed, at this session's first backward, on counting
            the terms in hand (``num_items`` or ``labels``) or not.
        row_tokens: packed rows of this many tokens (``Data(row_tokens=...)``), padded as rows; None: padded batches.
    """

    sync: Sync
    clock: Clock
    lengths: np.ndarray
    world_size: int
    owner: StepOwner
    listeners: list[StepListener] = field(default_factory=list)
    backward: Callable[[torch.Tensor], Any] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    accum_steps: int = 1
    labels: LabelCount | None = None
    planned_terms: str | None = None
    items_agreed: bool = False
    row_tokens: int | None = None
    _param_ids: frozenset[int] | None = field(default=None, repr=False)

    def param_ids(self) -> frozenset[int]:
        """``id`` of every parameter of the model (to tell the model's optimizer from others)."""
        if self._param_ids is None:
            self._param_ids = frozenset(id(p) for p in self.sync.model.parameters())
        return self._param_ids


def padded_tokens(lengths: np.ndarray, row_tokens: int | None) -> int:
    """Tokens a batch of samples of ``lengths`` computes on: its longest times its count, or
    for packed rows (``row_tokens``) its rows' tokens, the rows filled in order."""
    if not len(lengths):
        return 0
    if row_tokens is None:
        return int(len(lengths) * lengths.max())
    return row_count(lengths, row_tokens) * row_tokens


class _AccumulatingCheck:
    """An optimizer-step pre-hook armed over a micro-batch that only accumulates
    (``step.sync`` False): its gradient was not reduced, so an optimizer step there would
    move each rank on its own gradient and the replicas would drift apart without a word.
    Refused in one line before the step changes anything (another optimizer, of parameters
    outside the model, passes)."""

    def __init__(self, env: StepEnv, index: int) -> None:
        self.env, self.index = env, index

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ids = self.env.param_ids()
        if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(f"optimizer.step() in step {self.index}, a micro-batch that only accumulates (step.sync "
                             f"is False, accum_steps={self.env.accum_steps}): its gradient was not reduced across "
                             "ranks, so each rank would step on its own and the replicas drift apart; step the "
                             "optimizer (and zero the gradients) only when step.sync is True")


class Step:
    """One training step of one rank, open from :meth:`Session.step` until :meth:`end`.

    Attributes:
        index (int): steps (micro-batches) before this one in the run.
        epoch (int): the data plan's epoch this step belongs to.
        position (int): the step's place in its epoch's plan (-1: a deadline step's catch-up).
        indices (np.ndarray): this rank's sample indices for the step.
        weight (float): the factor :meth:`backward` multiplies the loss by (exact weighting,
            divided by ``accum_steps``).
        sync (bool): whether gradients are reduced in this step (step your optimizer only then:
            an optimizer step of the model's parameters in another is refused).
        skipped (bool): set it True when you skipped the optimizer step (reported as such).
        loss (torch.Tensor | None): the loss given to :meth:`backward` (a detached tensor), or None.
    """

    def __init__(self, env: StepEnv, *, index: int, epoch: int, position: int, indices: np.ndarray,
                 weight: float, sync: bool) -> None:
        self.env = env
        self.index, self.epoch, self.position = index, epoch, position
        self.indices, self.weight, self.sync = indices, weight, sync
        self.skipped = False
        self.loss: torch.Tensor | None = None
        self._items: float | None = None  # backward's num_items, if given
        self._marks: StepMarks | None = None
        self._cpu_from = self._thread_cpu_from = 0.0  # process and thread CPU seconds where the step began
        self._accumulating: RemovableHandle | None = None  # the optimizer-step check of a non-sync micro-batch

    @property
    def backward_done(self) -> bool:
        """Whether :meth:`backward` ran in this step."""
        return self._marks is not None and self._marks.backward_end is not None

    def sync_end(self) -> dict[str, Any]:
        """The arguments of the strategy's ``end_step`` for this step (its index, the loss terms
        this rank trained, whether the optimizer stepped): what :meth:`end` runs, and what a state
        saved inside the step keeps so a resume runs it (an outer step may be due there)."""
        if self._marks is None:
            raise ValueError(f"step {self.index} was never opened")
        tokens = float(self._marks.tokens) if self._items is None else self._items
        return {"index": self.index, "tokens": tokens, "optimizer_step": self.sync}

    def _open(self, data_s: float) -> None:
        env = self.env
        for listener in env.listeners:  # first: a listener may refuse the step before it opens
            listener.step_began(self.index)
        last_exit_cpu_s = env.owner.opened(self)
        if env.labels is not None:
            env.labels.reset()  # the count of this step's forward, not the last one's
        env.sync.begin_step(self.index)
        env.sync.micro_batch(self.sync)  # DDP's no_sync must cover the forward too: it arms the reduction there
        # CPU since the previous step ended (its data loading included), or from here for the first
        self._cpu_from = last_exit_cpu_s if last_exit_cpu_s is not None else time.process_time()
        self._thread_cpu_from = time.thread_time()
        lengths = env.lengths[self.indices]
        self._marks = StepMarks(index=self.index, start_time_s=time.time(), data_s=data_s, forward=env.clock.mark(),
                                indices=self.indices, samples=len(lengths), tokens=int(lengths.sum()),
                                padded_tokens=padded_tokens(lengths, env.row_tokens))
        if not self.sync:
            self._accumulating = register_optimizer_step_pre_hook(_AccumulatingCheck(env, self.index))

    def _disarm(self) -> None:
        if self._accumulating is not None:
            self._accumulating.remove()
            self._accumulating = None

    def _open_marks(self, what: str) -> StepMarks:
        """The marks of this step if it is open; a one-line error naming ``what`` otherwise."""
        if self._marks is None or not self.env.owner.is_open(self):
            raise ValueError(f"{what} on step {self.index}, which has ended: open one with session.step()")
        return self._marks

    def __enter__(self) -> Step:
        return self

    def _run_backward(self, weighted: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None) -> None:
        run = backward or self.env.backward
        self.env.sync.backward(weighted.backward if run is None else lambda: run(weighted))

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None = None, *,
                 num_items: float | torch.Tensor | None = None) -> None:
        """Weight ``loss`` (the mean over this rank's batch) and run backward; gradients are
        communicated here. ``backward``: your own backward call (``accelerator.backward``),
        given the weighted loss; default: the session's ``backward``, else ``loss.backward()``.

        ``num_items``: how many terms ``loss`` averages over in the batch in hand (tokens with a
        label, e.g. ``(labels[:, 1:] != -100).sum()`` for a Hugging Face causal LM, which shifts
        its labels). Given, the weight is this rank's share of the terms every rank counted (one
        small all-reduce: pass it on every rank alike), so the gradient is exact whatever
        ``Data.loss_terms`` says. None: without ``Data.loss_terms``, for a Hugging Face model given
        ``labels=`` in this step's forward, the terms its loss averages over are counted from them
        (:mod:`poise.run.terms`); otherwise the weight of the planned batches' ``loss_terms``.

        Raises:
            ValueError: after the step ended, a second time in one step, or (at the session's
                first backward) ``num_items`` given on some ranks only.
        """
        m = self._open_marks("step.backward()")
        if m.backward is not None:
            raise ValueError(f"step.backward() called twice in step {self.index}: once per step")
        env = self.env
        counted = num_items if num_items is not None else env.labels.count if env.labels is not None else None
        if not env.items_agreed:
            self._agree_on_counting(num_items is not None, counted is not None)
        weight = self.weight if counted is None else self._counted_weight(counted)
        m.backward = env.clock.mark()
        self._run_backward(loss * weight, backward)
        m.backward_end = env.clock.mark()
        m.compute_cpu_s = time.thread_time() - self._thread_cpu_from  # the forward since the step opened, and backward
        m.ready = env.sync.probe.last_ready
        m.in_flight = list(env.sync.probe.in_flight)
        self.loss = loss.detach()

    def _agree_on_counting(self, given: bool, counted: bool) -> None:
        """At the session's first backward, on every rank: whether each rank counts the terms in
        hand. A count on some ranks only would pair its all-reduce with another collective
        (gloo aborts, NCCL hangs or mixes buffers): refused in one line, naming the ranks.
        Without a count, say once what the planned weights assume."""
        env = self.env
        env.items_agreed = True
        mine = torch.tensor([float(given), float(counted)], dtype=torch.float64, device=env.device)
        every = [torch.zeros_like(mine) for _ in range(env.world_size)]
        dist.all_gather(every, mine)
        flags = torch.stack(every).cpu()
        if 0 < int(flags[:, 1].sum()) < env.world_size:
            on = [r for r in range(env.world_size) if flags[r, 1] > 0]
            off = [r for r in range(env.world_size) if flags[r, 1] == 0]
            what = "step.backward(num_items=...)" if flags[:, 0].any() else "labels= in the model's forward"
            raise ValueError(f"{what} counts the loss terms on rank(s) {on} but not on {off}: the count is summed "
                             "over the ranks, so give it on every rank alike (or on none)")
        if not counted and env.planned_terms is not None and dist.get_rank() == 0:
            log.warning("poise weighs each rank's mean loss by its share of the step's samples (%s): exact for a "
                        "loss averaged over samples; for one averaged over tokens give step.backward(loss, "
                        "num_items=<terms in the batch>) or Data(loss_terms=...)", env.planned_terms)

    def _counted_weight(self, num_items: float | torch.Tensor) -> float:
        """``world × mine / every rank's`` terms, divided by the accumulation: the weight of
        ``num_items`` terms in hand (an all-reduce of one number)."""
        mine = float(num_items.detach().sum()) if isinstance(num_items, torch.Tensor) else float(num_items)
        if not mine >= 0:
            raise ValueError(f"step.backward(num_items={mine!r}): give the count of loss terms in the batch, >= 0")
        self._items = mine
        scope = self.env.sync.loss_scope
        if scope.own:  # each rank's own mean; the outer step weighs the ranks by terms
            return self.weight
        total = torch.tensor([mine], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(total, group=scope.group)
        every = float(total.item())
        ranks = self.env.world_size if scope.ranks is None else len(scope.ranks)
        self.weight = (ranks * mine / every if every > 0 else 1.0) / self.env.accum_steps
        return self.weight

    def end(self) -> None:
        """Close the step (after your optimizer step) and record it.

        Raises:
            ValueError: when the step is not open, or no :meth:`backward` ran in it (a plain
                ``loss.backward()`` would leave the loss unweighted and the step untimed).
        """
        m = self._marks
        if m is None or not self.env.owner.is_open(self):
            raise ValueError(f"step {self.index} is not open: end() once per session.step()")
        env = self.env
        self._disarm()
        if m.backward is None:
            buckets = env.sync.probe.buckets_this_step
            self.abort()
            what = (f"{buckets} gradient buckets were reduced, so backward ran outside it: "
                    "call step.backward(loss), not loss.backward(), so the loss is weighted and timed"
                    if buckets else "no backward ran")
            raise ValueError(f"step {self.index} ended without step.backward(loss): {what}")
        env.sync.micro_batch(True)  # leave any accumulation context: the next step starts clean
        m.synced = env.clock.mark()
        env.sync.end_step(**self.sync_end())
        m.end = env.clock.mark()
        m.cpu_s = time.process_time() - self._cpu_from
        for listener in env.listeners:
            listener.step_ended(self.index)
        m.emulated_s = sum(listener.injected_s() for listener in env.listeners)
        stats, inter = env.sync.traffic()
        m.loss, m.skipped = self.loss, self.skipped
        m.raw_bytes, m.wire_bytes = stats.raw_bytes, stats.wire_bytes
        m.inter_node_raw_bytes, m.inter_node_wire_bytes = inter.raw_bytes, inter.wire_bytes
        m.codec_s = stats.encode_s + stats.decode_s
        env.owner.closed(self, m)

    def abort(self) -> None:
        """Close the step without recording it (an error interrupted it)."""
        self._disarm()
        self.env.sync.micro_batch(True)
        if self.env.owner.is_open(self):
            for listener in self.env.listeners:
                listener.step_ended(self.index)
            self.env.owner.aborted(self)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.end()


class DeadlineStep(Step):
    """A step under ``straggler`` (``poise/sync/deadline/``): micro-batches until the shared
    deadline, one :meth:`backward` each; the reduction is the exact mean over the loss terms
    every rank actually computed. It has :class:`Step`'s attributes, and these:

    Attributes:
        plan (StepPlan): the step's queues, deadline and counts
            (:class:`~poise.sync.deadline.StepPlan`).
        trained (np.ndarray): this rank's sample indices trained in the step (after :meth:`end`).
        empty (bool): no rank computed anything (skip the optimizer step: the gradient is zero).
    """

    def __init__(self, env: StepEnv, *, plan: StepPlan, index: int, epoch: int, position: int,
                 indices: np.ndarray) -> None:
        super().__init__(env, index=index, epoch=epoch, position=position, indices=indices, weight=0.0, sync=True)
        assert isinstance(env.sync, Deadline)
        self.deadline: Deadline = env.sync
        self.plan = plan
        self.trained = np.zeros(0, dtype=np.int64)
        self.empty = False
        self._loss_sum: torch.Tensor | None = None
        self._terms = 0.0
        self._micro: Generator[Any, None, None] | None = None

    def micro_batches(self, load: Callable[[np.ndarray], Any]) -> Iterator[Any]:
        """This rank's micro-batches until the deadline, each loaded by ``load(indices)``."""
        self._micro = self.deadline.runner.micro_batches(self.plan, load, self.deadline.micro_batch,
                                                         self._zero_reduce)
        return self._micro

    def _close_micro(self) -> None:
        """Close the micro-batch loop if it was left early: it holds the step's lock and watchdog."""
        if self._micro is not None:
            self._micro.close()
            self._micro = None

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], Any] | None = None, *,
                 num_items: float | torch.Tensor | None = None) -> None:
        """Weight ``loss`` (the mean over the micro-batch just handed out) and run backward.

        Raises:
            ValueError: with ``num_items``: deadline steps weigh micro-batches by the planned
                ``Data.loss_terms`` (the count of what every rank computed is agreed at the
                reduction), so give those instead.
        """
        if num_items is not None:
            raise ValueError("step.backward(num_items=...) in a deadline step: give Data(loss_terms=...) instead "
                             "(per-sample terms; the deadline's count of computed terms uses them)")
        m, plan, runner = self._open_marks("step.backward()"), self.plan, self.deadline.runner
        if plan.current is None or plan.backwards != plan.computed:
            raise ValueError(f"step.backward() in step {self.index}: once per micro-batch handed out by "
                             "micro_batches, inside its loop")
        plan.backwards += 1
        terms = runner.terms_of(plan.current)
        if plan.last:
            m.backward = self.env.clock.mark()
            runner.begin_reduce(plan, plan.current)
        self._run_backward(loss * (self.env.world_size * terms / plan.reference), backward)
        if plan.last:
            self._reduced(m)
        detached = loss.detach() * terms
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._terms += terms

    def _zero_reduce(self) -> None:
        m = self._marks
        assert m is not None
        m.backward = self.env.clock.mark()
        self.deadline.runner.begin_reduce(self.plan, None)
        self.deadline.zero_backward()
        self._reduced(m)

    def _reduced(self, m: StepMarks) -> None:
        m.backward_end = self.env.clock.mark()
        m.ready = self.deadline.probe.last_ready
        m.in_flight = list(self.deadline.probe.in_flight)
        self.deadline.runner.end_reduce(self.plan, self.deadline.model)

    def end(self) -> None:
        """Close the step (after your optimizer step): the pool and the record."""
        m = self._marks
        if m is None or not self.env.owner.is_open(self):
            raise ValueError(f"step {self.index} is not open: end() once per step")
        self._close_micro()
        if self.plan.current is not None:
            raise ValueError(f"step {self.index}: the micro-batch loop was left between a micro-batch and its "
                             "step.backward(loss): that micro-batch is claimed and would be lost; leave the "
                             "loop after a backward")
        if not self.plan.reduced:  # the micro-batch loop was left early: join the reduction now
            self.deadline.micro_batch(True)
            self._zero_reduce()
        self.trained = self.deadline.runner.finish_step(self.plan, sampler_step=self.position >= 0)
        self.empty = self.plan.total_terms == 0
        lengths = self.env.lengths[self.trained]
        m.indices, m.samples, m.tokens = self.trained, len(lengths), int(lengths.sum())
        m.padded_tokens = padded_tokens(lengths, self.env.row_tokens)
        self.loss = self._loss_sum / self._terms if self._loss_sum is not None and self._terms else None
        m.compute_cpu_s, m.compute_wall_s = self.plan.compute_cpu_s, self.plan.compute_wall_s
        self.skipped = self.skipped or self.empty
        super().end()

    def abort(self) -> None:
        """Close the step without recording it (an error interrupted it)."""
        self._close_micro()
        super().abort()


__all__ = ["DeadlineStep", "Step", "StepEnv", "StepListener", "StepOwner"]
