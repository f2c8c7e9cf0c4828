"""poise in your own training loop: :class:`Session`, between your loop and torch.distributed.

You keep your model, optimizer, dataset, loss and loop. A session, made once the process
group is up, gives you:

- ``session.model``: your model in DDP (or your DDP model), with poise's gradient codec
  registered as its comm hook behind the timing probe;
- ``session.sampler``: the batch sampler for your DataLoader (static, cost-balanced, or
  dynamically re-balanced from measured speeds);
- ``session.step()``: a context per step that weights your loss so that DDP's average is
  the exact gradient of the whole step's batch however unequal the ranks' batches are,
  measures this rank's data / compute / communication / idle / optimizer seconds, and feeds
  the re-planner;
- ``state_dict()`` / ``load_state_dict()``: all of poise's state, for your checkpoints;
- ``finish()``: ``report.json``, ``timeline.png``, ``trace.json`` and ``timeline.npz`` (the
  per-rank per-step table ``poise diagnose run`` reads) in ``out_dir``;
- ``metrics=MetricsConfig(port=...)``: live Prometheus metrics from rank 0 while it runs.

Example (under ``torchrun --nproc-per-node 2``)::

    dist.init_process_group("gloo")
    session = poise.Session(model, lengths=lengths, batch_size=16, balance="dynamic",
                            comm="topk", out_dir="runs/mine")
    loader = DataLoader(dataset, batch_sampler=session.sampler, collate_fn=collate)
    for epoch in range(epochs):
        session.sampler.set_epoch(epoch)
        for x, y in loader:
            with session.step() as step:
                step.backward(loss_fn(session.model(x), y))   # your loss: a mean over the batch
                optimizer.step()
                optimizer.zero_grad()
    session.finish()

``poise train`` runs its built-in tasks through this same class (``poise/runtime/worker.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from poise.balance.rebalance import DynamicPartitioner, window_terms
from poise.balance.sampler import BalancedBatchSampler, StaticSchedule, make_sampler, sampler_inputs
from poise.balance.weights import loss_weight
from poise.comm import builder as comm_builder
from poise.comm.probe import BucketProbe, instrumented
from poise.comm.settle import settle_buckets
from poise.comm.state import CommState
from poise.comm.trial import CodecTrial
from poise.config import BalanceConfig, CommConfig, DiagnosticsConfig, MetricsConfig, StragglerConfig
from poise.diagnostics import metrics as metrics_mod
from poise.diagnostics import report as report_mod
from poise.run.marks import StepMarks
from poise.diagnostics.timeline import StepRecord, Timeline
from poise.runtime import memory
from poise.runtime.clock import HostClock, clock_for
from poise.runtime.slowdown import apply_slowdown
from poise.run.step import DeadlineStep, Step
from poise.straggler.claims import store_claims
from poise.sync.deadline.runner import DeadlineRunner

log = logging.getLogger(__name__)
T = TypeVar("T")

Sampler = StaticSchedule | BalancedBatchSampler
# The entries of Session.state_dict() that belong to one rank; the rest every rank shares.
RANK_KEYS = ("rank", "window", "comm")


class Session:
    """poise attached to one rank of a user's own data-parallel training loop (see module doc).

    Every rank makes one, with the same arguments, after ``init_process_group``.

    Args:
        model: the model, a plain module (wrapped here in DDP) or a DDP model (no comm hook yet).
        lengths: per-sample size in tokens (metadata, one per dataset sample): what a sample
            costs to train on is ``cost_fn(length)``. None: every sample costs the same.
        costs: instead of ``lengths``, per-sample cost in any unit, used as it is.
        sampler: instead of ``lengths`` and a batch budget, a sampler of your own making
            (``poise.balance.make_sampler``, ``BalancedBatchSampler``, ``StaticSchedule``) for
            this rank; ``balance`` then only says whether to re-plan (``dynamic``).
        loss_terms: per-sample count of what your loss averages over (tokens predicted, or 1
            per sample, the default). The loss weight of :meth:`step` needs it to be exact.
        dataset: your dataset, only to check that ``lengths`` has one entry per sample.
        batch_size: samples per rank per step (static), or the step's budget as that many
            samples of average cost per rank (cost, dynamic).
        batch_tokens: instead, padded tokens per rank per step.
        batch_cost: instead, cost units per step over all ranks together (cost, dynamic).
        balance: ``static`` | ``cost`` | ``dynamic``, or a :class:`~poise.config.BalanceConfig`.
        rank_speed: ``RANK:SPEED,...`` (``"1:0.5"``): slow those ranks to that fraction of their
            speed, to emulate slower devices and try balancing on one machine (an emulation:
            a CPU quota, or sleeps in proportion to compute). Same as ``BalanceConfig.rank_speed``.
        comm: a codec name (``none``, ``fp16``, ``topk``, ``powersgd``, ...) or a
            :class:`~poise.config.CommConfig` (codec, error feedback, collective, buckets).
        straggler: ``off`` | ``deadline`` | ``deadline+stale``, or a
            :class:`~poise.config.StragglerConfig` (micro-batches, slack, predictor, injected
            delays): each rank computes micro-batches until the step's shared deadline, samples
            it did not reach go back into the epoch's plan (``poise/straggler/``). Steps are then
            run with ``for step, micro_batches in session.steps(loader)``.
        diagnostics: how often figures are gathered to rank 0 (a ``DiagnosticsConfig``).
        metrics: a ``MetricsConfig`` with a port: rank 0 serves live Prometheus metrics,
            updated at every gather (``poise/diagnostics/metrics.py``). None: off.
        out_dir: where :meth:`finish` writes (None: nothing is written, the report is returned).
        cost_fn: length -> cost units (a function of one number or of an array); default
            ``L + α·L²`` with the config's ``cost_alpha`` (attention) or α = 0 (linear).
        seed: seed of the data order, the same on every rank.
        accum_steps: micro-batches per optimizer step (gradient accumulation): the steps of
            a window but the last run under DDP's ``no_sync``; :attr:`Step.sync` says which.
        total_steps: optimizer steps the run will take, if known: lossy codecs start after a
            twentieth of it (see ``CommConfig.compression_start``).
        lr_warmup_steps: your learning-rate warm-up, in optimizer steps (same rule).
        backward: how :meth:`Step.backward` runs backward on the weighted loss when it is not
            given one (``accelerator.backward``, a grad scaler's); default ``loss.backward()``.
        keep_freed_memory: whether this process keeps the memory one step frees for the next
            (glibc: no page faults for the step's large tensors every step; free pages are
            given back past half of this worker's share of the machine's memory;
            ``poise/runtime/memory.py``). Process-wide. None, the default: when the model is
            on the CPU.
        rank, world_size: optional; when given they must match the process group.

    Raises:
        ValueError: one line naming the value, for settings that disagree with the process
            group, the dataset or each other.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lengths: Sequence[int] | np.ndarray | None = None,
        costs: Sequence[float] | np.ndarray | None = None,
        sampler: Sampler | None = None,
        loss_terms: Sequence[float] | np.ndarray | None = None,
        dataset: Any = None,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        batch_cost: float | None = None,
        balance: str | BalanceConfig = "cost",
        rank_speed: str = "",
        comm: str | CommConfig = "none",
        straggler: str | StragglerConfig = "off",
        diagnostics: DiagnosticsConfig | None = None,
        metrics: MetricsConfig | None = None,
        out_dir: str | Path | None = None,
        cost_fn: Callable[..., Any] | None = None,
        seed: int = 0,
        accum_steps: int = 1,
        total_steps: int | None = None,
        lr_warmup_steps: int = 0,
        backward: Callable[[torch.Tensor], Any] | None = None,
        keep_freed_memory: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._started_s = time.perf_counter()
        self._clock_s: float | None = None  # when the first step opened: training time counts from there
        self._eval_s = 0.0  # seconds spent in evaluate(), left out of the training time
        self._eval_curve: list[dict[str, float]] = []
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("poise.Session needs torch.distributed initialised first: call "
                             "dist.init_process_group(...) (torchrun sets the environment it reads)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if rank is not None and rank != self.rank:
            raise ValueError(f"rank={rank} but this process is rank {self.rank} of the process group")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"world_size={world_size} but the process group has {self.world_size} ranks")
        if accum_steps < 1:
            raise ValueError(f"accum_steps={accum_steps} must be >= 1")
        self.balance = BalanceConfig(strategy=balance) if isinstance(balance, str) else balance
        if rank_speed:
            if self.balance.rank_speed and self.balance.rank_speed != rank_speed:
                raise ValueError(f"rank_speed={rank_speed!r} but balance.rank_speed={self.balance.rank_speed!r}: "
                                 "give one of them")
            self.balance = dataclasses.replace(self.balance, rank_speed=rank_speed)
        self.comm = CommConfig(codec=comm) if isinstance(comm, str) else comm
        self.straggler = StragglerConfig(mode=straggler) if isinstance(straggler, str) else straggler
        if (self.straggler.enabled or self.straggler.delay) and accum_steps != 1:
            raise ValueError(f"accum_steps={accum_steps} with straggler.mode={self.straggler.mode!r} (or delays): "
                             "a deadline step accumulates its own micro-batches (straggler.micro_batches); "
                             "use accum_steps=1")
        self.diagnostics = diagnostics or DiagnosticsConfig()
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.accum_steps, self.total_steps = accum_steps, total_steps
        self.backend = str(dist.get_backend())
        self.backward = backward

        self.loss_terms = None if loss_terms is None else np.asarray(loss_terms, dtype=np.float64)
        if sampler is not None:
            if lengths is not None or costs is not None or cost_fn is not None or (batch_size, batch_tokens,
                                                                                    batch_cost) != (None,) * 3:
                raise ValueError("sampler= comes with its own lengths, costs and budget: give none of lengths, "
                                 "costs, cost_fn, batch_size, batch_tokens, batch_cost")
            if (sampler.rank, sampler.world_size) != (self.rank, self.world_size):
                raise ValueError(f"the sampler was made for rank {sampler.rank} of {sampler.world_size}, but this "
                                 f"process is rank {self.rank} of {self.world_size}")
            if self.balance.strategy == "dynamic" and not isinstance(sampler, BalancedBatchSampler):
                raise ValueError(f"balance 'dynamic' re-plans a BalancedBatchSampler, not a {type(sampler).__name__}")
            self.sampler: Sampler = sampler
        else:
            values, cost = sampler_inputs(lengths, costs, cost_fn, self.balance.cost_model, self.balance.cost_alpha,
                                          len(dataset) if dataset is not None else
                                          None if self.loss_terms is None else len(self.loss_terms))
            self.sampler = make_sampler(self.balance.strategy, values, rank=self.rank, world_size=self.world_size,
                                        cost_fn=cost, seed=seed, batch_size=batch_size, batch_tokens=batch_tokens,
                                        batch_cost=batch_cost, bucket_steps=self.balance.bucket_steps)
        self.lengths: np.ndarray = self.sampler.lengths
        if self.loss_terms is not None and len(self.loss_terms) != len(self.lengths):
            raise ValueError(f"loss_terms has {len(self.loss_terms)} entries but there are {len(self.lengths)} samples")
        if dataset is not None:
            self._check_dataset(dataset)

        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        keep = self.device.type == "cpu" if keep_freed_memory is None else keep_freed_memory
        self.freed_memory = memory.keep_freed_memory() if keep else None
        collective_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self.partitioner = None
        if self.balance.strategy == "dynamic":
            assert isinstance(self.sampler, BalancedBatchSampler)
            b = self.balance
            self.partitioner = DynamicPartitioner(
                self.sampler, cold_start_steps=b.cold_start_steps, window_steps=b.window_steps,
                replan_every_steps=b.replan_every_steps, max_share_change=b.max_share_change,
                confident_error=b.confident_error, fit_alpha=b.fit_alpha, device=collective_device,
            )

        # Deadline steps (and injected delays): one rank's state, see poise/straggler/steps.py.
        self.deadline: DeadlineRunner | None = None
        if self.straggler.enabled or self.straggler.delay:
            cost = getattr(self.sampler, "cost_fn", None)
            costs = np.asarray(cost(self.lengths) if cost is not None else self.lengths, dtype=np.float64)
            self.deadline = DeadlineRunner(self.straggler, rank=self.rank, world_size=self.world_size, costs=costs,
                                           loss_terms=self.loss_terms, device=collective_device, seed=seed,
                                           claims=store_claims(self.rank, self.world_size, collective_device),
                                           pauses=self.straggler.delay_model(seed))
        # Emulated slowness is installed around the step and the hook, never passed into them.
        self.slowdown = apply_slowdown(self.rank, self.balance.rank_speeds(), self.balance.slowdown_method,
                                       torch.get_num_threads(), noise=self.balance.speed_noise, seed=seed,
                                       noise_steps=self.balance.speed_noise_steps)
        self.clock = clock_for(self.device)
        self.probe = BucketProbe(self.clock)
        optimizer_steps = total_steps if total_steps is not None else 0
        self.compression_start = self.comm.compression_start(optimizer_steps, lr_warmup_steps)
        self.model, self.comm_state = self._wrap(model)
        # -- live metrics (rank 0): fed by the timeline's gathers, no collective of their own
        self.metrics = metrics_mod.start(metrics, self.world_size) if metrics is not None and self.rank == 0 else None
        self.timeline = Timeline(self.rank, self.world_size, self.diagnostics.gather_every_steps, collective_device,
                                 on_gather=self._publish_metrics if self.metrics is not None else None)
        # -- end of live metrics
        self.steps_done = 0  # steps (micro-batches) recorded, over all epochs
        self.last_record: StepRecord | None = None
        self._pending: deque[StepMarks] = deque()
        self._lag = 0 if isinstance(self.clock, HostClock) else 1  # CUDA: read a step's events one step later
        self._active: Step | None = None
        self._last_exit_s: float | None = None
        self._last_exit_cpu_s: float | None = None  # time.process_time() then: a step's CPU counts from there

    # -- set-up ----------------------------------------------------------------------------

    def _wrap(self, model: nn.Module) -> tuple[DistributedDataParallel, CommState]:
        comm_builder.check_backend(self.comm, self.backend)
        single = comm_builder.requires_single_bucket(self.comm)
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if isinstance(model, DistributedDataParallel):
            ddp = model
            if single and ddp.bucket_bytes_cap < size_mb * 2**20:
                raise ValueError(f"comm.codec={self.comm.codec!r} needs one bucket on gloo: build DDP with "
                                 f"bucket_cap_mb > {size_mb:.1f} (the model's size in MB)")
        else:
            bucket_cap_mb = self.comm.bucket_mb
            if single:
                bucket_cap_mb = 2 * size_mb + 1
                log.info("comm.codec=%r needs a single bucket on gloo: bucket size %.1f MB instead of comm.bucket_mb",
                         self.comm.codec, bucket_cap_mb)
            ddp = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                bucket_cap_mb=bucket_cap_mb,
            )
        hook, state = comm_builder.build(self.comm, start_step=self.compression_start)
        if self.deadline is not None and self.deadline.stash is not None:
            hook = self.deadline.stash.wrap(hook)  # sees each bucket before the codec does
        # order matters: the emulated slowness must happen before the probe reads the clock
        ddp.register_comm_hook(state, self.slowdown.wrap_hook(instrumented(hook, self.probe)))
        return ddp, state

    def dataloader(self, dataset: Any, **kwargs: Any) -> DataLoader:
        """``DataLoader(dataset, batch_sampler=self.sampler, **kwargs)``, after checking that
        the dataset has one sample per entry of ``lengths``."""
        self._check_dataset(dataset)
        return DataLoader(dataset, batch_sampler=self.sampler, **kwargs)

    def _check_dataset(self, dataset: Any) -> None:
        if len(dataset) != len(self.lengths):
            raise ValueError(f"the dataset has {len(dataset)} samples but lengths has {len(self.lengths)}")

    def settle_buckets(self, forward_backward: Callable[[], None]) -> None:
        """Before :meth:`load_state_dict` of a run with a lossy codec: one throw-away
        ``forward_backward`` (nothing changes) so DDP settles its bucket layout and restored
        residuals land on the entries they were saved for (``poise.comm.settle``)."""
        settle_buckets(self.model, self.comm_state, forward_backward)

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
        if self._active is not None:
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
        weight = loss_weight(batches, self.rank, self.loss_terms)
        # Data time: since the batch was asked of the sampler (the DataLoader then fetches and
        # collates it), or since the last step ended if it was prefetched before that.
        since = max(handed_s, self._last_exit_s) if self._last_exit_s is not None else handed_s
        step = Step(self, index=self.steps_done, epoch=epoch, position=position, indices=batches[self.rank],
                    weight=weight / self.accum_steps, sync=sync)
        step._open(data_s=max(0.0, time.perf_counter() - since))
        if self._clock_s is None:
            self._clock_s = time.perf_counter()
        return step

    def steps(self, loader: Iterable[Any]) -> Iterator[tuple[Step, Any]]:
        """``(step, batch)`` for every batch of ``loader``, each step open while you train on its
        batch: it ends when the loop asks for the next one (or leaves the loop). Replaces
        ``for batch in loader:`` with one changed line; call ``step.backward(loss)``.

        With ``straggler`` on (or delays injected), it yields ``(step, micro_batches)`` instead:
        run ``step.backward(loss)`` for each micro-batch it hands out, then your optimizer step
        (skip it when ``step.empty``: no rank computed anything). The micro-batches are fetched
        here, from ``loader.dataset`` with ``loader.collate_fn``, in this process (a DataLoader's
        workers would load samples the deadline may not reach; those go back into the epoch's
        plan). After the epoch's last planned step come the catch-up steps of what was deferred.
        """
        if self.deadline is not None:
            yield from self._deadline_steps(loader)
            return
        for batch in loader:
            step = self.step()
            try:
                yield step, batch
            except GeneratorExit:  # the loop was left with break (or an error) inside this step
                if step.backward_done:
                    step.end()
                else:
                    step.abort()
                raise
            if self._active is step:  # not ended by the loop itself
                step.end()

    def _deadline_steps(self, loader: Any) -> Iterator[tuple[DeadlineStep, Iterator[Any]]]:
        if getattr(loader, "batch_sampler", None) is not self.sampler:
            raise ValueError("session.steps(loader) with straggler on: the loader must have "
                             "batch_sampler=session.sampler (micro-batches are fetched from loader.dataset)")
        dataset, collate = loader.dataset, loader.collate_fn

        def load(indices: np.ndarray) -> Any:
            return collate([dataset[int(i)] for i in indices])

        def one(catch_up: bool) -> Iterator[tuple[DeadlineStep, Iterator[Any]]]:
            step = self._deadline_step(catch_up)
            try:
                yield step, step.micro_batches(load)
            except GeneratorExit:  # the loop was left inside this step
                if self._active is step:
                    step.end() if step.plan.settled else step.abort()
                raise
            if self._active is step:  # not ended by the loop itself
                step.end()

        assert self.deadline is not None
        for _ in self.sampler:  # this rank's batch of each planned step; its micro-batches are loaded in the step
            yield from one(False)
        while len(self.deadline.pool):  # the epoch's deferred samples, every rank agreeing on the pool
            yield from one(True)

    def _deadline_step(self, catch_up: bool) -> DeadlineStep:
        assert self.deadline is not None
        if self._active is not None:
            raise ValueError("a deadline step while another step is open")
        if catch_up:
            epoch, position, handed_s, batches = self.sampler.epoch, -1, time.perf_counter(), None
        else:
            epoch, position, handed_s = self.sampler.handed.popleft()
            batches = self.sampler.global_batches(position)
        plan = self.deadline.plan_step(self.steps_done, batches)
        queue = plan.queues.micro[self.rank]
        step = DeadlineStep(self, plan=plan, index=self.steps_done, epoch=epoch, position=position,
                            indices=np.concatenate(queue) if queue else np.zeros(0, dtype=np.int64))
        since = max(handed_s, self._last_exit_s) if self._last_exit_s is not None else handed_s
        step._open(data_s=max(0.0, time.perf_counter() - since))
        plan.started_s = time.perf_counter()
        if self._clock_s is None:
            self._clock_s = plan.started_s
        return step

    def _close_step(self, marks: StepMarks) -> None:
        self._active = None
        self._last_exit_s = time.perf_counter()
        self._last_exit_cpu_s = time.process_time()
        self._pending.append(marks)
        self.steps_done += 1
        if self.freed_memory is not None:
            self.freed_memory.after_step()
        while len(self._pending) > self._lag:
            self._take(self._pending.popleft())
        if self.comm_state.between_steps():  # auto's dry run: no step's seconds
            self._last_exit_s, self._last_exit_cpu_s = time.perf_counter(), time.process_time()
        if self.partitioner is not None and self.partitioner.due(self.steps_done - len(self._pending)):
            if self.total_steps is None or self.steps_done < self.total_steps * self.accum_steps:
                self.partitioner.replan(self.steps_done)

    def _take(self, marks: StepMarks) -> None:
        rec = marks.record(self.clock)
        self.timeline.record(rec)
        if self.codec_trial is not None:
            self.codec_trial.observe(rec.step, rec.step_s, rec.comm_wait_s)
        if self.partitioner is not None:
            self.partitioner.observe(self.lengths[marks.indices], rec.compute_s)
        self.last_record = rec

    def _publish_metrics(self, block: np.ndarray) -> None:
        """Rank 0, after each gather: the new block to the metrics endpoint."""
        assert self.metrics is not None
        self.metrics.observe(block, replans=len(self.partitioner.history) if self.partitioner else 0)

    def _drain(self) -> None:
        while self._pending:
            self._take(self._pending.popleft())

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """All of poise's state on this rank: data position and plan, speeds and the re-planner's
        measurements, the comm hook's state (error-feedback residuals, warm starts). Plain
        values and tensors (``torch.save`` with ``weights_only=True`` loads it). Rank-specific
        parts (residuals, this rank's measurements) are marked with the rank they belong to.

        No collective: any rank can call it at any time, e.g. rank 0 alone for its checkpoint.
        """
        claimed = self.sampler.handed[0][1] if self.sampler.handed else self.sampler.position
        partitioner = self.partitioner.state_dict() if self.partitioner else None
        window = None
        if partitioner is not None:
            window = partitioner.pop("window")
            window += [window_terms(self.lengths[m.indices], m.record(self.clock).compute_s) for m in self._pending]
        return {
            "rank": self.rank, "world_size": self.world_size, "steps_done": self.steps_done,
            "sampler": self.sampler.state_dict(position=claimed),
            "partitioner": partitioner,
            "window": window,
            "comm": self.comm_state.state_dict(),
            "comm_shared": self.comm_state.shared_state_dict(),
            "straggler": self.deadline.state_dict() if self.deadline is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`). From another rank, or a run with
        another number of ranks, only the shared part is used (the data position; on another
        world size the rest of the epoch is re-planned over the new ranks) and residuals and
        speed measurements start fresh. Call before the first step; with a lossy codec call
        :meth:`settle_buckets` first."""
        for key in ("rank", "world_size", "steps_done", "sampler", "comm", "comm_shared"):
            if key not in state:
                raise ValueError(f"not a poise session state: {key!r} is missing (keys: {sorted(state)})")
        if self.steps_done:
            raise ValueError(f"load_state_dict after {self.steps_done} steps: load before the first step")
        same_world = int(state["world_size"]) == self.world_size
        own = same_world and int(state["rank"]) == self.rank
        self.sampler.load_state_dict(state["sampler"])
        if self.partitioner is not None and state.get("partitioner") and own and state.get("window") is not None:
            self.partitioner.load_state_dict({**state["partitioner"], "window": state["window"]})
        if own:
            self.comm_state.load_state_dict(state["comm"])
        else:
            # every rank must agree on the hook's step (whether compression has started)
            self.comm_state.load_shared_state_dict(state.get("comm_shared") or {"step": 0})
            log.info("session state of rank %s of %s loaded on rank %d of %d: data position only",
                     state["rank"], state["world_size"], self.rank, self.world_size)
        if self.deadline is not None and state.get("straggler") and same_world:
            self.deadline.load_state_dict(state["straggler"])
        self.steps_done = int(state["steps_done"]) if same_world else 0

    @property
    def codec_trial(self) -> CodecTrial | None:
        """``comm.codec=auto``'s decision (None for other codecs): ``.choice`` is None until the dry
        runs are in, then True if PowerSGD compresses from ``.start`` on, False if gradients stay exact."""
        return self.comm_state.trial

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self, fn: Callable[[], T]) -> T:
        """Run your evaluation ``fn`` now, between steps, and record its loss against the
        training time so far; returns what ``fn`` returns (a loss, or an object with ``.loss``).

        Why: a speed-up that costs accuracy is only real at equal accuracy, so the report's
        ``eval_curve`` lists ``{"step", "train_s", "loss"}`` per call: optimizer steps done,
        seconds of training since the first step opened on this rank (the time of every
        evaluation left out), and the loss in your unit. ``poise bench accuracy`` reads the
        time to a target loss from it. If ``fn`` is a collective (a sharded evaluation), call
        this on every rank; rank 0's record goes into the report.

        Raises:
            ValueError: inside an open step, or when ``fn``'s result has no loss.
        """
        if self._active is not None:
            raise ValueError("session.evaluate() inside an open step: evaluate between steps")
        start = time.perf_counter()
        train_s = start - self._clock_s - self._eval_s if self._clock_s is not None else 0.0
        result = fn()
        self._eval_s += time.perf_counter() - start
        loss = result if isinstance(result, (int, float)) else getattr(result, "loss", None)
        if not isinstance(loss, (int, float)):
            raise ValueError(f"session.evaluate(): fn returned {type(result).__name__}, which is neither a number "
                             "nor has a numeric .loss")
        self._eval_curve.append({"step": self.steps_done // self.accum_steps, "train_s": train_s,
                                 "loss": float(loss)})
        return result

    # -- the end ---------------------------------------------------------------------------

    def finish(self, extra: dict[str, Any] | None = None, *, loss_scale: float = 1.0) -> dict[str, Any] | None:
        """Gather every rank's figures and, on rank 0, write ``report.json``, ``trace.json`` and
        ``timeline.png`` into ``out_dir``. A collective: call on every rank, once, at the end.

        ``extra`` is added to the report (your eval metrics, say); ``loss_scale`` converts the
        recorded training loss (nats, as your loss returns it) into the unit you report.
        Returns the report on rank 0, None elsewhere; every rank returns once the outputs are
        on disk (so no rank tears the process group down while rank 0 still writes).

        Raises:
            ValueError: inside an open step, or when no step was recorded (on every rank).
            RuntimeError: on the other ranks, when rank 0 could not write (rank 0 re-raises its error).
        """
        if self._active is not None:
            raise ValueError("session.finish() inside an open step")
        if self.steps_done == 0:
            raise ValueError("session.finish(): no step was recorded: run steps inside `with session.step()`")
        self._drain()
        self.timeline.flush()
        slowdowns: list[Any] = [None] * self.world_size
        dist.all_gather_object(slowdowns, {"speed": self.slowdown.speed, "method": self.slowdown.method,
                                           "from_step": self.slowdown.from_step, "noise": self.slowdown.noise,
                                           "straggler": self.deadline.summary() if self.deadline else None,
                                           "memory": memory.summary(self.freed_memory)})
        report, failure, error = None, [None], None
        if self.rank == 0:
            try:
                report = self._report(slowdowns, extra, loss_scale)
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
        return report

    def _report(self, slowdowns: list[Any], extra: dict[str, Any] | None, loss_scale: float) -> dict[str, Any]:
        """Rank 0: the report from the gathered timeline, written into ``out_dir`` if set."""
        table = self.timeline.table()
        report: dict[str, Any] = {
            "world_size": self.world_size,
            "backend": self.backend,
            "wall_s": time.perf_counter() - self._started_s,
            **report_mod.summarize(table, loss_scale=loss_scale),
            "balance_strategy": self.balance.strategy,
            "codec": self.comm.codec,
            "compression_start_step": self.compression_start,  # optimizer steps sent uncompressed first
            "codec_trial": self.codec_trial.summary() if self.codec_trial else None,
            "replans": [e.__dict__ for e in self.partitioner.history] if self.partitioner else [],
            "straggler": [d.pop("straggler") for d in slowdowns],  # per rank; None: off
            "freed_memory": [d.pop("memory") for d in slowdowns],  # per rank (poise/runtime/memory.py)
            "emulated_slowdown": slowdowns,  # speed 1.0, method 'none' = not slowed
            "eval_curve": self._eval_curve,  # rank 0's evaluate() calls: step, train_s (s), loss
            **(extra or {}),
        }
        if self.out_dir is not None:
            report_mod.write_outputs(self.out_dir, report, table, plot=self.diagnostics.plot)
        if self.metrics is not None:
            self.metrics.close()  # the job is over: release the port
        return report


__all__ = ["RANK_KEYS", "DeadlineStep", "Session", "Step"]
