"""The loop ``poise train`` runs on every rank: :func:`train`.

It trains a built-in task exactly as a user's own script does, through :class:`poise.Session`
(the DDP model with the codec hook and the timing probe, exact loss weights, measurements,
re-planning, state and outputs), with the recipe of :mod:`poise.train.recipe`. :func:`train`
reads top to bottom: build the task, its sampler, the model, the session, the optimizer and its
schedule; resume from a checkpoint when there is one; one loop over steps, each followed by the
same bookkeeping (progress and log, a checkpoint when due, evaluation and the early stop); then
the end (the final checkpoint, the evaluation, the report). Rank 0 writes ``report.json``,
``trace.json`` and ``timeline.png`` into the config's ``out_dir``.

Nothing here emulates anything: the session installs ``config.emulate`` (slow ranks, injected
delays, a planned kill, a slow input pipeline around the loader's collate) around the step, as
it would for a user's script.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from poise import checkpoint
from poise import config as config_mod
from poise.balance.packed_sampler import PackedBatchSampler
from poise.config import RunConfig
from poise.log import StepProgress, step_progress
from poise.run.data import Data
from poise.run.session import Session
from poise.runtime import dist as rdist
from poise.tasks.base import Batch, Task
from poise.train.data import build_sampler, build_task_once_per_node
from poise.train.evaluate import EvalResult, evaluate
from poise.train.optim import AdamW
from poise.train.recipe import (
    clip_and_step,
    freeze,
    lr_schedule,
    lr_warmup,
    make_optimizer,
    schedule_span,
    seed_everything,
)
from poise.train.samples import SampleLog

if TYPE_CHECKING:
    from poise.run.step import DeadlineStep

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What :func:`train` builds once, for every step and the end of the run.

    Attributes:
        total_micro: micro-batch steps the whole run trains (an optimizer step takes
            ``train.accum_steps`` of them).
        attempt: how many times the launcher restarted the workers before this attempt.
        start_step: micro-batch steps done before this attempt (0 unless resumed).
        resumed_from: the checkpoint this attempt started from (None: a fresh start).
        saver: writes checkpoints (None without ``checkpoint.every_steps``).
        samples: this rank's record of trained samples (None without ``diagnostics.record_samples``).
    """

    config: RunConfig
    ctx: rdist.DistContext
    task: Task
    session: Session
    optimizer: AdamW
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total_micro: int
    attempt: int
    start_step: int = 0
    resumed_from: str | None = None
    saver: checkpoint.Checkpointer | None = None
    samples: SampleLog | None = None


@dataclass
class Position:
    """Where the loop is: micro-batch steps done, the sampler's epoch, the step count at the last
    checkpoint (None: none this attempt), and the evaluation that met ``train.stop_at_eval_loss``
    (None until one does)."""

    steps_done: int
    epoch: int
    last_saved: int | None
    reached: EvalResult | None = None


def train(config: RunConfig, ctx: rdist.DistContext) -> dict | None:
    """Run the configured job on this rank through :class:`poise.Session`, as a user's script
    would; rank 0 writes the outputs and returns the report (None on other ranks, and when a
    resumed attempt found nothing left to train)."""
    tc = config.train
    torch.set_num_threads(rdist.threads_for(config, ctx.local_world_size))
    seed_everything(tc.seed, ctx.rank)
    task = build_task_once_per_node(config, ctx)
    sampler = build_sampler(config, task, ctx.rank, ctx.world_size)
    # The sampler's steps are micro-batches: an optimizer step takes accum_steps of them.
    total_micro = (config.total_steps * tc.accum_steps if config.total_steps is not None
                   else sampler.steps_in_epochs(tc.epochs or 0))
    optimizer_steps = math.ceil(total_micro / tc.accum_steps)
    torch.manual_seed(tc.seed)  # the same initial weights everywhere (DDP also broadcasts them)
    model = task.build_model().to(ctx.device)
    freeze(model, tc.frozen_prefixes())
    if config.parallel.sharded:  # FSDP2: each block, then the root (poise/train/shard.py)
        from poise.train.shard import shard_model  # FSDP2's code: imported for a sharded run only

        model = shard_model(model, config.parallel, config.comm, world_size=ctx.world_size,
                            nproc=config.dist.nproc, device=ctx.device)
    # packed rows: the sampler's pieces carry their own loss terms (each piece's tokens but the first)
    data = Data(sampler=sampler, loss_terms=task.train_targets if task.row_tokens is None else None, seed=tc.seed,
                accum_steps=tc.accum_steps, total_steps=optimizer_steps,
                lr_warmup_steps=lr_warmup(tc.warmup_steps, optimizer_steps))
    session = Session(model, data, balance=config.balance, comm=config.comm, straggler=config.straggler,
                      sync=config.sync,
                      emulate=config.emulate, diagnostics=config.diagnostics, metrics=config.metrics,
                      out_dir=config.out_dir, keep_freed_memory=config.dist.keep_freed_memory)
    trainable = [p for p in session.model.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, config, task, session.compression_start)
    scheduler = lr_schedule(optimizer, tc.warmup_steps, schedule_span(config, session, optimizer_steps))
    job = Job(config, ctx, task, session, optimizer, scheduler, total_micro, attempt=rdist.restart_count())
    job.start_step, job.resumed_from = resume(job)
    job.saver, job.samples = open_outputs(job)
    log.info("training %s: %d params, %d train samples, %d steps, balance %s, codec %s",
             task.name, sum(p.numel() for p in session.model.parameters()), len(task.train_lengths), total_micro,
             config.balance.strategy, session.comm.codec)

    loader = session.dataloader(task.train_set, collate_fn=task.collate)
    pos = Position(job.start_step, session.sampler.epoch, job.start_step if job.resumed_from else None)
    with step_progress(config.diagnostics.progress and ctx.is_main, total_micro) as progress:
        # epochs: every epoch to its end (after an elastic resume, the step count is another one)
        while pos.reached is None and more_to_train(job, pos):
            session.sampler.set_epoch(pos.epoch)  # keeps a resumed epoch's position
            for item in (session.steps(loader) if session.deadline is not None else loader):
                if session.deadline is not None:
                    deadline_step(job, *item)
                else:
                    plain_step(job, item, last=ends_after_this_batch(job, pos))
                show_progress(job, progress)
                pos.steps_done += 1
                save_if_due(job, pos)
                if stop_after_eval(job, pos) or (tc.epochs is None and pos.steps_done >= total_micro):
                    break
            pos.epoch += 1

    close_outputs(job, pos)
    if job.resumed_from is not None and pos.steps_done == job.start_step:
        # resumed from the run's final checkpoint (the failure came after it, in evaluation or
        # the report): no step ran in this attempt, so there is nothing to report
        log.warning("resumed from %s, the run's final checkpoint: nothing left to train", job.resumed_from)
        return None
    return finish(job, pos.reached)


# -- before the loop --------------------------------------------------------------------------


def resume_point(config: RunConfig, ctx: rdist.DistContext, attempt: int,
                 below: int | None = None) -> tuple[str, dict] | None:
    """The checkpoint to start from (of a step before ``below``, when given), agreed by all
    ranks (rank 0 looks, verifies and tells).

    ``--resume`` asks for one (its absence is an error); after the launcher restarted the
    workers, a job that saves checkpoints resumes from its newest good one, if any.
    """
    cc = config.checkpoint
    if not cc.resume and not cc.every_steps:
        return None
    answer: list = [None, None]
    if ctx.is_main:
        try:
            if cc.resume or attempt > 0:
                answer[0] = checkpoint.find_resume_point(config, required=cc.resume and attempt == 0, below=below)
            else:
                checkpoint.check_fresh_start(config)
        except ValueError as exc:
            answer[1] = str(exc)
    dist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise ValueError(answer[1])
    return answer[0]


def resume(job: Job) -> tuple[int, str | None]:
    """Restore the model, optimizer, schedule and session from :func:`resume_point`'s checkpoint;
    the micro-batch steps it had done and its path (0 and None when starting fresh).

    A checkpoint that verifies may still fail to load or to go into the live objects on some
    rank (its own file damaged, a state that does not fit the model): then every rank passes
    it over for the previous good one, as for a checkpoint that does not verify. A checkpoint
    of another run (:class:`~poise.checkpoint.DoesNotFit`) is the user's error and stops the job.

    Raises:
        ValueError: the checkpoint does not fit this run, or none can be loaded although one
            was asked for (``--resume``) or the live state was already changed by a failed one.
    """
    module = job.session.module
    below: int | None = None
    touched, failure = False, ""
    while True:
        found = resume_point(job.config, job.ctx, job.attempt, below)
        if found is None:
            if failure and touched:
                raise ValueError(f"no checkpoint in {job.config.checkpoint_dir} can be restored: {failure}")
            return 0, None
        resumed_from, manifest = found
        if below is None:
            job.session.settle_buckets(lambda: throwaway_step(job))
        error = ""
        try:
            state = checkpoint.load(job.config, resumed_from, manifest, rank=job.ctx.rank,
                                    world_size=job.ctx.world_size, model=module)
            problems = checkpoint.live_problems(state, module, job.optimizer)
            if problems:
                raise ValueError(f"it does not fit the live model: {'; '.join(problems[:2])}")
        except checkpoint.DoesNotFit:
            raise
        except Exception as exc:  # any load failure: fall back to the previous good checkpoint
            error = describe(exc)
        # every rank goes in, or none does: a sharded restore is a collective, and a rank that
        # restored while another could not load would leave the job's ranks in two states
        loaded = [""] * job.ctx.world_size
        dist.all_gather_object(loaded, error)
        ready = not any(loaded)
        if ready:
            try:
                touched = True
                checkpoint.restore(state, model=module, optimizer=job.optimizer, scheduler=job.scheduler,
                                   session=job.session)
            except checkpoint.DoesNotFit:
                raise
            except Exception as exc:
                error = describe(exc)
        outcomes: list[tuple[str, bool]] = [("", False)] * job.ctx.world_size
        dist.all_gather_object(outcomes, (error, touched))
        bad = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
        if not bad:
            start_step = int(state.shared["step"])
            log.info("resumed from %s at step %d (launcher attempt %d)", resumed_from, start_step, job.attempt)
            return start_step, resumed_from
        touched = any(t for _, t in outcomes)
        failure = f"rank {bad[0][0]}: {bad[0][1]}"
        if job.ctx.is_main:
            log.warning("checkpoint %s verifies but cannot be restored (%s); trying the previous one",
                        resumed_from, failure)
        below = int(manifest["step"])


def describe(exc: BaseException) -> str:
    """An exception in one line of at most 300 characters: its type and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def throwaway_step(job: Job) -> None:
    """A forward and backward on one training sample whose gradient is thrown away, so that DDP
    settles its buckets before the checkpoint's state goes in; every RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):  # leave every RNG as the checkpoint will set it
        batch = job.task.collate([job.task.train_set[0]]).to(job.ctx.device)
        job.task.train_loss(job.session.model, batch).backward()


def open_outputs(job: Job) -> tuple[checkpoint.Checkpointer | None, SampleLog | None]:
    """The checkpoint saver and this rank's sample record, each when the config asks for it (the
    record is cut back to ``job.start_step``: a collective, so after :func:`resume`)."""
    config, ctx = job.config, job.ctx
    saver = None
    if config.checkpoint.every_steps:
        saver = checkpoint.Checkpointer(config, rank=ctx.rank, world_size=ctx.world_size, store=ctx.store,
                                        attempt=job.attempt, model=job.session.module)
    samples = SampleLog.open(Path(config.out_dir), ctx, job.start_step) if config.diagnostics.record_samples else None
    return saver, samples


# -- one step and the bookkeeping after it ----------------------------------------------------


def more_to_train(job: Job, pos: Position) -> bool:
    """Whether another pass over the sampler is due: epochs left (``train.epochs``), else steps left."""
    epochs = job.config.train.epochs
    return pos.epoch < epochs if epochs is not None else pos.steps_done < job.total_micro


def ends_after_this_batch(job: Job, pos: Position) -> bool:
    """Whether the batch the loader just handed out is the run's last (its step must sync)."""
    epochs = job.config.train.epochs
    if epochs is None:
        return pos.steps_done + 1 == job.total_micro
    # the DataLoader takes one batch at a time here (no workers): position is this batch's + 1
    sampler = job.session.sampler
    return pos.epoch + 1 == epochs and sampler.position == len(sampler)


def optimizer_step(job: Job, index: int) -> bool:
    """:func:`~poise.train.recipe.clip_and_step` with the run's settings; True when skipped."""
    return clip_and_step(job.session.model, job.optimizer, job.scheduler, job.config.train.grad_clip_norm, index,
                         job.config.comm.on_nonfinite, job.ctx.rank)


def plain_step(job: Job, batch: Batch, *, last: bool) -> None:
    """One micro-batch: backward, and the optimizer step at the end of an accumulation window
    (``last``: the run's final batch, which ends its window early)."""
    with job.session.step(sync=True if last else None) as step:
        if job.samples is not None:
            job.samples.write(step.index, step.epoch, step.indices)
        step.backward(job.task.train_loss(job.session.model, batch.to(job.ctx.device)))
        if step.sync:
            step.skipped = optimizer_step(job, step.index)


def deadline_step(job: Job, step: DeadlineStep, micro_batches: Iterable[Batch]) -> None:
    """One straggler-tolerant step: the micro-batches this rank reaches before the deadline, then
    the optimizer step (none when no rank computed anything: the gradient is zero)."""
    for batch in micro_batches:
        step.backward(job.task.train_loss(job.session.model, batch.to(job.ctx.device)))
    if step.empty:
        job.optimizer.zero_grad(set_to_none=True)
    else:
        step.skipped = optimizer_step(job, step.index)
    step.end()
    if job.samples is not None:
        job.samples.write(step.index, step.epoch, step.trained)


def show_progress(job: Job, progress: StepProgress) -> None:
    """The progress bar and the periodic log line from the session's last record (on CUDA, the
    step before: its events are read a step late).

    Raises:
        FloatingPointError: for a non-finite training loss under ``comm.on_nonfinite='error'``.
    """
    rec = job.session.last_record
    if rec is None:
        return
    if rec.samples and not math.isfinite(rec.loss) and job.config.comm.on_nonfinite == "error":
        raise FloatingPointError(f"training loss is {rec.loss} at step {rec.step} on rank {job.ctx.rank} "
                                 "(comm.on_nonfinite='skip' skips such steps instead)")
    rate = rec.samples / rec.step_s if rec.step_s > 0 else 0.0
    progress.update(rec.step, f"loss {rec.loss:.3f}  {rate * job.ctx.world_size:.0f} samples/s")
    if job.ctx.is_main and (rec.step + 1) % job.config.diagnostics.log_every_steps == 0:
        log.info("step %d/%d loss %.4f step %.0f ms", rec.step + 1, job.total_micro, rec.loss, rec.step_s * 1e3)


def save(job: Job, steps_done: int, *, final: bool = False) -> None:
    """Checkpoint the run after ``steps_done`` micro-batch steps (mid-window when they do not end
    an accumulation window; the ``final`` one never is: the run's last batch ends its window);
    the stall it caused goes to the metrics."""
    assert job.saver is not None
    module = job.session.module
    in_window = not final and steps_done % job.config.train.accum_steps != 0
    stall_s = job.saver.save(checkpoint.capture(
        step=steps_done, model=module, optimizer=job.optimizer, scheduler=job.scheduler, session=job.session,
        world_size=job.ctx.world_size, in_window=in_window))
    if job.session.metrics is not None:
        job.session.metrics.observe_checkpoint(stall_s)


def save_if_due(job: Job, pos: Position) -> None:
    """A checkpoint every ``checkpoint.every_steps``."""
    if job.saver is not None and job.saver.due(pos.steps_done):
        save(job, pos.steps_done)
        pos.last_saved = pos.steps_done


def run_eval(job: Job) -> EvalResult:
    """The held-out evaluation of the bare model (all ranks take part)."""
    tc = job.config.train
    return evaluate(job.session.module, job.task, job.ctx, max_samples=job.config.task.eval_max_samples,
                    batch_size=tc.batch_size or job.task.default_batch_size)


def stop_after_eval(job: Job, pos: Position) -> bool:
    """Evaluate every ``train.eval_every`` optimizer steps before the last; True (and
    ``pos.reached`` set) when the evaluation met ``train.stop_at_eval_loss``."""
    tc = job.config.train
    due = tc.eval_every and pos.steps_done % (tc.eval_every * tc.accum_steps) == 0
    if not due or pos.steps_done >= job.total_micro:
        return False
    result = job.session.evaluate(lambda: run_eval(job))
    if tc.stop_at_eval_loss is None or result.loss > tc.stop_at_eval_loss:
        return False
    log.info("step %d: eval loss %.4f reached train.stop_at_eval_loss=%g: stopping",
             pos.steps_done // tc.accum_steps, result.loss, tc.stop_at_eval_loss)
    pos.reached = result
    return True


# -- the end of the run -----------------------------------------------------------------------


def close_outputs(job: Job, pos: Position) -> None:
    """Save the end of the run (always) and wait for the saver; close the sample record."""
    if job.saver is not None:
        if pos.last_saved != pos.steps_done:
            save(job, pos.steps_done, final=True)
        job.saver.wait()
    if job.samples is not None:
        job.samples.close()


def packing_figures(sampler: object) -> dict | None:
    """Packed rows' figures for the report (None for padded batches): the row length, the
    naive packer or poise's, and this rank's seconds spent planning steps (every rank plans
    every step alike), per step planned."""
    if not isinstance(sampler, PackedBatchSampler):
        return None
    steps = max(sampler.planned_steps, 1)
    return {"row_tokens": sampler.row_tokens, "packer": "naive" if sampler.naive else "poise",
            "plan_ms_per_step": 1e3 * sampler.plan_s / steps, "planned_steps": sampler.planned_steps}


def finish(job: Job, reached: EvalResult | None) -> dict | None:
    """Evaluate the trained model (unless ``reached`` already did) and write the report; rank 0
    returns it."""
    config, session = job.config, job.session
    if config.comm.local_first:
        # the ranks' weights differ by their unsent residuals: evaluate the weights rank 0 saved
        for tensor in session.module.state_dict().values():
            dist.broadcast(tensor, src=0)
    result = reached if reached is not None else session.evaluate(lambda: run_eval(job))
    report = session.finish({
        "task": job.task.name,
        "loss_unit": result.unit,
        "eval_loss": result.loss,
        "eval_accuracy": result.accuracy,
        "eval_count": result.count,
        "stopped_at_eval_loss": reached is not None,  # train.stop_at_eval_loss was met before the last step
        "variance_frozen_after": job.optimizer.param_groups[0]["freeze_after"],  # optimizer steps; None: never
        "restarts": job.attempt,
        "resumed_from": job.resumed_from,
        "first_step": job.start_step,
        "checkpoints": job.saver.report() if job.saver is not None else None,
        "packing": packing_figures(session.sampler),
        "config": config_mod.to_dict(config),
    }, loss_scale=job.task.loss_in_unit(1.0), optimizer=job.optimizer)
    if report is not None:
        log.info("done: eval loss %.4f %s, accuracy %.2f%%, %.1f samples/s, balance %.3f",
                 result.loss, result.unit, 100 * result.accuracy, report["throughput_samples_per_s"],
                 report["balance"])
    return report
