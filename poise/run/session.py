"""poise in your own training loop: :class:`Session`, between your loop and torch.distributed.

You keep your model, optimizer, dataset, loss and loop. A session, made once the process
group is up, gives your DataLoader a balanced batch sampler (``session.sampler``), wraps your
model for the synchronization strategy (``session.model``: DDP with poise's codec hook
behind the timing probe), weights each step's loss so the reduced gradient is exact however
unequal the ranks' batches (``session.steps(loader)``, ``session.step()``), measures every
rank, re-plans, keeps its state for your checkpoints (``state_dict()``) and writes the
report, timeline and trace at the end (``finish()``).

Example (under ``torchrun --nproc-per-node 2``)::

    dist.init_process_group("gloo")
    session = poise.Session(model, poise.Data(lengths=lengths, batch_size=16), balance="dynamic",
                            comm="topk", out_dir="runs/mine")
    loader = session.dataloader(dataset, collate_fn=collate)
    for epoch in range(epochs):
        session.sampler.set_epoch(epoch)
        for step, (x, y) in session.steps(loader):
            step.backward(loss_fn(session.model(x), y))   # your loss: a mean over the batch
            optimizer.step()
            optimizer.zero_grad()
    session.finish()

How it is put together: :mod:`poise.run.build` (the parts), :mod:`poise.run.step` (a step),
:mod:`poise.run.deadline_loop` (deadline steps), :mod:`poise.run.record` (records and the report),
:mod:`poise.sync` (the strategy). ``poise train`` runs its tasks through this same class (``poise/train/loop.py``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from poise.balance.rebalance import DynamicPartitioner
from poise.balance.replay import ReplayedPartitioner
from poise.comm.trial import CodecTrial
from poise.config import BalanceConfig, CommConfig, DiagnosticsConfig, EmulateConfig, MetricsConfig, StragglerConfig
from poise.config.former import CHANGES, FormerName, former_keywords
from poise.config.sync import SyncConfig
from poise.decide import decisions
from poise.diagnostics import report as report_mod
from poise.diagnostics.metrics import MetricsExporter
from poise.diagnostics.timeline import StepRecord
from poise.run import build as build_mod
from poise.run.data import DATA_FIELDS, Data, Sampler, check_loader, loader_dataset
from poise.run.deadline_loop import DeadlineLoop
from poise.run.record import run_keys, warn_unfinished, write_report
from poise.run.state import load_session_state, session_state
from poise.run.step import DeadlineStep, Step, StepEnv, StepListener
from poise.run.terms import install_label_count, planned_terms
from poise.runtime import dist as rdist
from poise.runtime import memory
from poise.runtime.clock import Clock
from poise.sync import Deadline, Sync

T = TypeVar("T")
log = logging.getLogger(__name__)


class Session:
    """poise attached to one rank of a user's own data-parallel training loop: it gives your
    DataLoader a balanced batch sampler (:attr:`sampler`), wraps your model for the
    synchronization strategy (:attr:`model`), weights each step's loss so the reduced gradient is
    exact (:meth:`steps`, :meth:`step`), measures every rank, re-plans, keeps its state for your
    checkpoints (:meth:`state_dict`) and writes the report, timeline and trace (:meth:`finish`).

    Every rank makes one, with the same arguments, after ``init_process_group``.

    Args:
        model: the model, a plain module (wrapped here in DDP), a DDP model (no comm hook yet),
            or one sharded with ``fully_shard`` (FSDP2, HSDP: :class:`poise.sync.Sharded`).
        data: what is trained on (:class:`poise.Data`: lengths or costs, loss terms, the
            budget per step, seed, accumulation, run length), or a sampler of your own making.
        balance: ``auto`` (the default: plain DDP's samples per step, split by each rank's
            measured speed from the first steps on; ``poise/decide/``) | ``static`` | ``cost`` |
            ``dynamic``, or a :class:`~poise.config.BalanceConfig`.
        comm: a codec name (``none``: exact, ``powersgd``, ...), a CommConfig, or None: poise decides.
        straggler: ``off`` | ``deadline`` | ``deadline+stale``, or a
            :class:`~poise.config.StragglerConfig`: each rank computes micro-batches until the
            step's shared deadline; samples it did not reach go back into the epoch's plan
            (``poise/sync/deadline/``). Steps then run with ``for step, micro_batches in
            session.steps(loader)``.
        sync: how often the ranks' models meet: ``step`` (every step, DDP), ``local_sgd``,
            ``diloco``, ``streaming`` (an outer step every ``inner_steps``: no all-reduce in
            between; ``poise/sync/outer.py``), ``auto`` (chosen from timings), or a
            :class:`~poise.config.SyncConfig`.
        emulate: emulated slowness for trying poise on one machine: a ``RANK:SPEED,...`` string
            (``"1:0.5"``: rank 1 at half speed) or an :class:`~poise.config.EmulateConfig`
            (speed noise, injected delays, a planned kill, a slow input pipeline). None: none.
        diagnostics: how often figures are gathered to rank 0 (a ``DiagnosticsConfig``).
        metrics: a ``MetricsConfig`` with a port: rank 0 serves live Prometheus metrics,
            updated at every gather (``poise/diagnostics/metrics.py``). None: off.
        out_dir: where :meth:`finish` writes (None: nothing is written, the report is returned).
        keep_freed_memory: whether this process keeps the memory one step frees for the next
            (glibc: no page faults for the step's large tensors every step; free pages are
            given back past half of this worker's share of the machine's memory;
            ``poise/runtime/memory.py``). Process-wide. None, the default: when the model is
            on the CPU.

    Attributes:
        backward: how :meth:`Step.backward` runs backward on the weighted loss when it is not
            given one (set it to ``accelerator.backward``, a grad scaler's); None:
            ``loss.backward()``.

    Raises:
        ValueError: one line naming the value, for settings that disagree with the process
            group, the dataset or each other.
    """

    def __init__(self, model: nn.Module, data: Data | Sampler, *, balance: str | BalanceConfig = "auto",
                 comm: str | CommConfig | None = None, straggler: str | StragglerConfig = "off",
                 sync: str | SyncConfig = "step", emulate: str | EmulateConfig | None = None,
                 diagnostics: DiagnosticsConfig | None = None, metrics: MetricsConfig | None = None,
                 out_dir: str | Path | None = None, keep_freed_memory: bool | None = None) -> None:
        self._started_s = time.perf_counter()
        self.data = data if isinstance(data, Data) else Data(sampler=data)
        self.balance = BalanceConfig(strategy=balance) if isinstance(balance, str) else balance
        self.comm = CommConfig(codec=comm) if isinstance(comm, str) or comm is None else comm
        self.straggler = StragglerConfig(mode=straggler) if isinstance(straggler, str) else straggler
        self.sync_config = SyncConfig(mode=sync) if isinstance(sync, str) else sync
        self.emulate = EmulateConfig(rank_speed=emulate) if isinstance(emulate, str) else emulate or EmulateConfig()
        self.diagnostics = diagnostics or DiagnosticsConfig()
        self.out_dir = Path(out_dir) if out_dir is not None else None
        parts = build_mod.build(model, self.data, balance=self.balance, comm=self.comm, straggler=self.straggler,
                                sync_config=self.sync_config,
                                emulate=self.emulate, diagnostics=self.diagnostics, metrics=metrics,
                                keep_freed_memory=keep_freed_memory)
        self.rank, self.world_size, self.backend = parts.rank, parts.world_size, parts.backend
        self.device: torch.device = parts.device
        self.sampler: Sampler = parts.sampler
        self.lengths: np.ndarray = parts.sampler.lengths
        self.loss_terms: np.ndarray | None = parts.loss_terms
        self.accum_steps, self.total_steps = self.data.accum_steps, self.data.total_steps
        self.partitioner: DynamicPartitioner | ReplayedPartitioner | None = parts.partitioner
        self.clock: Clock = parts.clock
        self.sync: Sync = parts.sync
        self.metrics: MetricsExporter | None = parts.metrics
        self.freed_memory: memory.FreedMemory | None = parts.freed_memory
        self.compression_start, self.comm, self._codec_why = parts.compression_start, parts.comm, parts.codec_why
        self._emulation = parts.emulation
        self._recorder = parts.recorder
        self._env = StepEnv(sync=parts.sync, clock=parts.clock, lengths=self.lengths, world_size=self.world_size,
                            owner=parts.recorder, listeners=list(parts.emulation.listeners),
                            device=parts.collective_device, accum_steps=self.accum_steps,
                            # given loss_terms stand; else a Hugging Face model's labels= are counted
                            labels=install_label_count(parts.sync.model) if self.loss_terms is None else None,
                            planned_terms=planned_terms(self.loss_terms, self.lengths),
                            row_tokens=getattr(self.sampler, "row_tokens", None))
        self._loop_step: Step | None = None  # the step a session.steps loop holds open
        # a forgotten finish() is said when the session is dropped (the end of a main()) or at exit
        weakref.finalize(parts.recorder, warn_unfinished, parts.recorder.progress, self.rank)
        rdist.close_at_exit()  # the process group goes before the interpreter finalizes (see there)

    def add_listener(self, listener: StepListener) -> None:
        """Tell ``listener`` when each step begins and ends (``step_began(index)``,
        ``step_ended(index)``, ``injected_s()``: see :class:`poise.run.step.StepListener`); the
        adapters check their framework's state there, emulation installs itself there."""
        self._env.listeners.append(listener)

    @classmethod
    def from_kwargs(cls, model: nn.Module, **kwargs: Any) -> Session:
        """A session from one flat set of keywords: :class:`Data`'s fields and this class's own
        (what the Lightning and Accelerate adapters take, e.g. ``lengths=..., batch_size=16,
        comm="fp16"``).

        Raises:
            ValueError: one line naming a keyword that is neither.
        """
        unknown = sorted(set(kwargs) - set(DATA_FIELDS) - set(SESSION_KEYWORDS))
        former = former_keywords(unknown)
        if former:  # a keyword of an older poise: say what replaced it
            raise FormerName(f"session keyword(s) {', '.join(former)} ({CHANGES})")
        if unknown:
            raise ValueError(f"unknown session keyword(s) {', '.join(unknown)}: allowed are "
                             f"{', '.join(sorted(DATA_FIELDS + SESSION_KEYWORDS))}")
        data = Data(**{k: v for k, v in kwargs.items() if k in DATA_FIELDS})
        return cls(model, data, **{k: v for k, v in kwargs.items() if k in SESSION_KEYWORDS})

    # -- what a loop reads -------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The model to train: yours, as the synchronization strategy wrapped it (DDP; a
        ``fully_shard`` model is its own)."""
        return self.sync.model

    @property
    def module(self) -> nn.Module:
        """Your module without any wrapper (DDP's ``.module``; a ``fully_shard`` model itself):
        what to save, load and evaluate."""
        model = self.sync.model
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def backward(self) -> Callable[[torch.Tensor], Any] | None:
        """How :meth:`Step.backward` runs backward on the weighted loss when not given a way:
        ``accelerator.backward``, a grad scaler's, ...; None: ``loss.backward()``."""
        return self._env.backward

    @backward.setter
    def backward(self, run: Callable[[torch.Tensor], Any] | None) -> None:
        self._env.backward = run  # the steps read it at each backward

    @property
    def open_step(self) -> Step | None:
        """The step open now (from :meth:`step` or :meth:`steps` until it ends), or None."""
        return self._recorder.active

    @property
    def steps_done(self) -> int:
        """Steps (micro-batches) recorded so far, over all epochs (resumed ones included)."""
        return self._recorder.steps_done

    @property
    def last_record(self) -> StepRecord | None:
        """The latest step's figures (on CUDA, the step before: its events are read a step late)."""
        return self._recorder.last_record

    @property
    def codec_trial(self) -> CodecTrial | None:
        """``comm.codec=auto``'s decision (None for other codecs): ``.choice`` is None until the dry
        runs are in, then True if PowerSGD compresses from ``.start`` on, False if gradients stay exact."""
        return getattr(self.sync, "trial", None)

    @property
    def deadline(self) -> Deadline | None:
        """The deadline strategy (``straggler`` on, or delays emulated), else None."""
        return self.sync if isinstance(self.sync, Deadline) else None

    def dataloader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        """``DataLoader(dataset, batch_sampler=self.sampler, **kwargs)``, after checking that
        the dataset has one sample per entry of ``lengths`` (and with an emulated slow input
        pipeline around ``collate_fn``, if one is configured). With packed rows
        (``Data(row_tokens=...)``) the loader reads the dataset's documents as pieces
        (:class:`poise.run.packed.PieceView`): your collate gets each rank's pieces row by row."""
        dataset = loader_dataset(dataset, self.sampler)
        collate = self._emulation.wrap_collate(kwargs.pop("collate_fn", None))
        if collate is not None:
            kwargs["collate_fn"] = collate
        return DataLoader(dataset, batch_sampler=self.sampler, **kwargs)

    def settle_buckets(self, forward_backward: Callable[[], None]) -> None:
        """Before :meth:`load_state_dict` of a run with a lossy codec: one throw-away
        ``forward_backward`` (nothing changes) so DDP settles its bucket layout and restored
        residuals land on the entries they were saved for (``poise.comm.settle``)."""
        self.sync.settle(forward_backward)

    # -- steps -----------------------------------------------------------------------------

    def step(self, *, sync: bool | None = None) -> Step:
        """Open this rank's next training step: the one of the batch the DataLoader just gave.

        Use it as a context (``with session.step() as step:``, closed at the block's end) or
        call :meth:`Step.end` yourself (adapters do, from their framework's hooks). The step's
        clock starts now; its data time is the time the DataLoader took to produce the batch.

        ``sync``: whether this micro-batch ends its accumulation window (gradients are
        reduced; step the optimizer). None: every ``accum_steps``-th step does.

        Raises:
            ValueError: when no batch of ``session.sampler`` is waiting (the DataLoader uses
                another sampler), or a step is already open.
        """
        if self._recorder.active is not None:
            raise ValueError("session.step() while another step is open: one step per batch, one at a time")
        if self.deadline is not None:
            raise ValueError(f"straggler.mode={self.straggler.mode!r}: a step is a series of micro-batches; run "
                             "`for step, micro_batches in session.steps(loader)` and step.backward(loss) for each")
        if not self.sampler.handed:
            raise ValueError("session.step(): no batch from session.sampler is waiting: give your DataLoader "
                             "batch_sampler=session.sampler (or use session.dataloader(dataset)), one step per batch")
        epoch, position, handed_s = self.sampler.handed.popleft()
        batches = self.sampler.global_batches(position)
        if sync is None:
            sync = (self.steps_done + 1) % self.accum_steps == 0
        # an outer strategy trains each rank on its own mean and weighs the ranks at the outer step
        weight = self.sync.loss_scope.weight(batches, self.rank, self.loss_terms)
        step = Step(self._env, index=self.steps_done, epoch=epoch, position=position, indices=batches[self.rank],
                    weight=weight / self.accum_steps, sync=sync)
        step._open(data_s=self._recorder.data_s(handed_s))
        return step

    def steps(self, loader: Iterable[Any]) -> Iterator[tuple[Step, Any]]:
        """``(step, batch)`` for every batch of ``loader``, each step open while you train on its
        batch: it ends when the loop asks for the next one (or leaves the loop). Replaces
        ``for batch in loader:`` with one changed line; call ``step.backward(loss)``.

        With deadline steps (``straggler`` on, or delays emulated), it yields ``(step,
        micro_batches)`` instead: run ``step.backward(loss)`` for each micro-batch it hands
        out, then your optimizer step (skip it when ``step.empty``: no rank computed anything).
        The micro-batches are fetched here, from ``loader.dataset`` with ``loader.collate_fn``,
        in this process (a DataLoader's workers would load samples the deadline may not reach;
        those go back into the epoch's plan). After the epoch's last planned step come the
        catch-up steps of what was deferred.
        """
        check_loader(loader, self.sampler, self.lengths)
        if self.deadline is not None:
            loop = DeadlineLoop(self._env, self.sampler, self._recorder, self.rank)
            yield from loop.steps(loader, self._hand_out)
            return
        for batch in loader:
            step = self.step()
            yield from self._hand_out(step, batch)

    def _hand_out(self, step: Step, item: Any) -> Iterator[tuple[Any, Any]]:
        """Yield ``(step, item)``; end the step when the loop comes back, unless it ended it."""
        self._loop_step = step
        try:
            yield step, item
        except GeneratorExit:  # the loop was left with break (or an error) inside this step
            self._close_loop_step()
            raise
        if self._recorder.is_open(step):  # not ended by the loop itself
            step.end()
        self._loop_step = None

    def _close_loop_step(self) -> None:
        """Close the step a ``session.steps`` loop holds open when the loop is left, or when
        ``evaluate``/``finish`` come first (a loop left with ``break`` while the iterator is still
        referenced): recorded if its work was done, else dropped (its batch is trained again)."""
        step, self._loop_step = self._loop_step, None
        if step is None or not self._recorder.is_open(step):
            return
        done = step.plan.settled if isinstance(step, DeadlineStep) else step.backward_done
        step.end() if done else step.abort()

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """All of poise's state on this rank: data position and plan, speeds and the re-planner's
        measurements, the strategy's state (error-feedback residuals, warm starts). Plain
        values and tensors (``torch.save`` with ``weights_only=True`` loads it). Rank-specific
        parts (residuals, this rank's measurements) are marked with the rank they belong to.

        Inside an open step (the natural place: after ``optimizer.step()`` in a ``session.steps``
        loop), a step whose backward ran counts as done, and the strategy's end of it (an outer
        step due there) runs in the resumed session before its first step; one whose backward
        did not run is trained again after a resume.

        No collective: any rank can call it at any time, e.g. rank 0 alone for its checkpoint.
        """
        return session_state(**self._state_parts())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`). From another rank, or a run with
        another number of ranks, only the shared part is used (the data position; on another
        world size the rest of the epoch is re-planned over the new ranks) and residuals and
        speed measurements start fresh. Call before the first step; with a lossy codec call
        :meth:`settle_buckets` first."""
        load_session_state(state, **self._state_parts())

    def _state_parts(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "sampler": self.sampler, "recorder": self._recorder,
                "partitioner": self.partitioner, "sync": self.sync, "deadline": self.deadline}

    # -- evaluation and the end ---------------------------------------------------------------

    def evaluate(self, fn: Callable[[], T]) -> T:
        """Run your evaluation ``fn`` now, between steps, and record its loss against the
        training time so far; returns what ``fn`` returns (a loss, or an object with ``.loss``).

        Why: a speed-up that costs accuracy is only real at equal accuracy, so the report's
        ``eval_curve`` lists ``{"step", "train_s", "loss"}`` per call: optimizer steps done,
        seconds of training since the first step opened on this rank (the time of every
        evaluation left out), and the loss in your unit. ``poise bench accuracy`` reads the
        time to a target loss from it. If ``fn`` is a collective (a sharded evaluation), call
        this on every rank; rank 0's record goes into the report.

        Inside a ``session.steps`` loop, after the step's backward (and your optimizer step), the
        step is recorded first: the evaluation is not part of it.

        Raises:
            ValueError: inside an open step, or when ``fn``'s result has no loss.
        """
        self._close_loop_step()
        return self._recorder.evaluate(fn, self.steps_done // self.accum_steps)

    def finish(self, extra: dict[str, Any] | None = None, *, loss_scale: float = 1.0,
               optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any] | None:
        """Gather every rank's figures and, on rank 0, write ``report.json``, ``trace.json`` and
        ``timeline.png`` into ``out_dir``. A collective: call on every rank, once, at the end.

        However the loop ended (its last step, an early stop, a ``break``), every rank holds the
        same parameters afterwards: an outer strategy (local SGD, DiLoCo, Streaming) stopped
        before ``total_steps`` takes its final synchronization here. Save the model after it.

        ``extra`` is added to the report (your eval metrics, say); ``loss_scale`` converts the
        recorded training loss (nats, as your loss returns it) into the unit you report.
        ``optimizer``, if given, adds each rank's training state to the report (``per_rank``'s
        ``memory.model_state_mb``: parameters, gradients and optimizer state this rank holds, a
        shard's part when sharded), beside its peak resident memory.
        Returns the report on rank 0, None elsewhere; every rank returns once the outputs are
        on disk (so no rank tears the process group down while rank 0 still writes).

        Raises:
            ValueError: inside an open step, or when no step was recorded (on every rank).
            RuntimeError: on the other ranks, when rank 0 could not write (rank 0 re-raises its error).
        """
        self._close_loop_step()  # a session.steps loop left with break: its last step is closed here
        if self._recorder.active is not None:
            raise ValueError("session.finish() inside an open step")
        if self.steps_done == 0:
            raise ValueError("session.finish(): no step was recorded: run steps inside `with session.step()`")
        self._recorder.end_saved_step()  # resumed from a state saved inside the last step: its outer step
        if not self.sync.conclude() and self.rank == 0:  # the replicas meet, however the loop ended
            log.warning("session.finish(): the ranks hold different parameters (%s cannot synchronize them at the "
                        "end): save every rank's model, not rank 0's alone", self.sync.summary()["mode"])
        deadline = self.deadline
        state = None if optimizer is None else memory.state_bytes(self.module, optimizer)
        per_rank = {**self._emulation.describe(), "memory": memory.summary(self.freed_memory, state),
                    "straggler": deadline.runner.summary() if deadline is not None else None}

        def make_report(gathered: list[dict[str, Any]], table: Any) -> dict[str, Any]:  # rank 0
            report = {"world_size": self.world_size, "backend": self.backend,
                    "wall_s": time.perf_counter() - self._started_s,
                    **report_mod.summarize(table, loss_scale=loss_scale),
                    "balance_strategy": self.balance.strategy, "codec": self.comm.codec,
                    **({"codec_by_poise": self._codec_why} if self._codec_why else {}),
                    **({"balance_sampler": {"type": type(self.sampler).__name__, "replanned": bool(self.partitioner)}}
                       if self.data.sampler is not None else {}),
                    "sync": self.sync.summary(),
                    **run_keys(self._recorder, gathered, compression_start=self.compression_start,
                               trial=self.codec_trial, partitioner=self.partitioner),
                    **(extra or {})}
            # every choice in force, when and why, and what pins it (poise/decide/decisions.py)
            return {**report, "decisions": [d.as_dict() for d in decisions(report)]}

        report = write_report(self._recorder, rank=self.rank, world_size=self.world_size, per_rank=per_rank,
                              make_report=make_report, out_dir=self.out_dir, plot=self.diagnostics.plot)
        if self.metrics is not None:
            self.metrics.close()  # the job is over: release the port
        return report


# The keywords of Session.from_kwargs besides Data's fields: the session's own settings.
SESSION_KEYWORDS = ("balance", "comm", "straggler", "sync", "emulate", "diagnostics", "metrics", "out_dir",
                    "keep_freed_memory")

__all__ = ["DATA_FIELDS", "SESSION_KEYWORDS", "Data", "DeadlineStep", "Session", "Step"]
