"""The per-rank entry point: ``torchrun ... -m poise.runtime.worker --config DIR/config.toml``.

``poise train`` starts this module through torch's elastic launcher; users can start it
with a plain ``torchrun`` just as well. It reads the resolved config, joins the process
group, builds the task, its sampler, model and optimizer, and then trains exactly as a
user's own script does: through :class:`poise.Session` (the DDP model with the codec hook
and the timing probe, exact loss weights, measurements, re-planning, state and outputs).
Rank 0 writes ``report.json``, ``trace.json`` and ``timeline.png`` into the config's ``out_dir``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from poise import checkpoint, optim
from poise import config as config_mod
from poise.config import RunConfig
from poise.log import step_progress
from poise.runtime import dist as rdist
from poise.runtime import entry
from poise.runtime.data import build_sampler
from poise.runtime.evaluate import EvalResult, evaluate
from poise.runtime.faults import FaultPlan, restart_count
from poise.runtime.samples import SampleLog
from poise.session import Session
from poise.tasks.base import Task
from poise.tasks.registry import build_task

# By name: run as `-m poise.runtime.worker`, __name__ would be "__main__", outside "poise".
log = logging.getLogger("poise.runtime.worker")


def seed_everything(seed: int, rank: int) -> None:
    """Seed python, numpy and torch; ranks get distinct streams (dropout etc.)."""
    random.seed(seed * 1000 + rank)
    np.random.seed(seed * 1000 + rank)
    torch.manual_seed(seed * 1000 + rank)


def build_task_once_per_node(config: RunConfig, ctx: rdist.DistContext) -> Task:
    """Local rank 0 builds first (it may index and cache the corpus); the others then load
    the cache instead of all parsing the same files at once."""
    if ctx.local_rank != 0:
        dist.barrier()
    task = build_task(config)
    if ctx.local_rank == 0:
        dist.barrier()
    return task


def make_optimizer(params: Any, config: RunConfig, task: Task, compression_start: int | None = None) -> optim.AdamW:
    """AdamW with the run's learning rate and weight decay, fused: one kernel over every
    parameter instead of a Python loop (about 6x faster on CPU for a 19M-parameter model,
    which matters once compression has taken communication out of the step). With
    ``comm.freeze_variance`` its second moment freezes when compression starts, after
    ``compression_start`` steps (see ``poise/optim.py``; None: nothing is compressed)."""
    freeze = compression_start is not None and config.comm.freezes_variance()
    freeze_after = max(1, compression_start) if freeze else None
    return optim.AdamW(params, lr=config.train.lr or task.default_lr, weight_decay=config.train.weight_decay,
                       fused=True, freeze_after=freeze_after)


def lr_warmup(warmup_steps: int, total_steps: int) -> int:
    """The warm-up :func:`lr_schedule` uses: ``warmup_steps``, at most a tenth of a short run."""
    return min(warmup_steps, max(1, total_steps // 10))


def schedule_span(config: RunConfig, session: Session, optimizer_steps: int) -> Callable[[], int]:
    """The learning-rate schedule's span, in optimizer steps: ``train.schedule_steps`` (default
    the whole run) while gradients go exact, the whole run once they go lossy (a lossy codec, or
    ``auto`` keeping PowerSGD), because each lossy step is worth less and the run's extra steps
    are there for it. So ``auto`` that drops PowerSGD follows plain DDP's schedule, step for step."""
    exact_span = config.train.schedule_steps or optimizer_steps
    codec = config.comm.codec
    if codec != "auto":
        span = optimizer_steps if codec in config_mod.LOSSY_CODECS else exact_span
        return lambda: span
    trial = session.codec_trial
    return lambda: optimizer_steps if trial is not None and trial.choice else exact_span


def lr_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int | Callable[[], int]
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to 10% of the peak at ``total_steps``, where it stays
    (a run longer than its schedule trains on at that rate). ``total_steps`` may be a function,
    read at every step: :func:`schedule_span`'s span is known only once ``comm.codec=auto`` chose."""
    span = total_steps if callable(total_steps) else lambda: total_steps

    def factor(step: int) -> float:
        total = span()
        warmup = lr_warmup(warmup_steps, total)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> None:
    """Keep the parameters whose names start with one of ``prefixes`` fixed (fine-tuning).

    Raises:
        ValueError: for a prefix that names no parameter, or when nothing would be trained.
    """
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(n.startswith(prefix) for n in names):
            roots = sorted({n.split(".")[0] for n in names})
            raise ValueError(f"train.frozen: {prefix!r} names no parameter; top-level names are {', '.join(roots)}")
    for name, param in model.named_parameters():
        if name.startswith(prefixes):
            param.requires_grad_(False)
    if prefixes and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"train.frozen={','.join(prefixes)!r} freezes every parameter: nothing would train")


def resume_point(config: RunConfig, ctx: rdist.DistContext, attempt: int) -> tuple[str, dict] | None:
    """The checkpoint to start from, agreed by all ranks (rank 0 looks, verifies and tells).

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
                answer[0] = checkpoint.find_resume_point(config, required=cc.resume and attempt == 0)
            else:
                checkpoint.check_fresh_start(config)
        except ValueError as exc:
            answer[1] = str(exc)
    dist.broadcast_object_list(answer, src=0)
    if answer[1]:
        raise ValueError(answer[1])
    return answer[0]


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip_norm: float, step: int,
                  on_nonfinite: str = "skip", rank: int = 0) -> bool:
    """Clip the gradient norm, step the optimizer and the schedule; True when skipped.

    The total norm is needed anyway for clipping; it also tells whether the reduced gradient
    is finite. A NaN/Inf that a codec let through (``comm.on_nonfinite='skip'``) skips the
    optimizer on every rank alike, since every rank holds the same reduced gradient; with
    ``on_nonfinite='error'`` it raises FloatingPointError naming ``step`` and ``rank`` instead.
    """
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm if grad_clip_norm > 0 else math.inf)
    skipped = not math.isfinite(float(norm))
    if skipped and on_nonfinite == "error":
        raise FloatingPointError(f"gradient norm is {float(norm)} at step {step} on rank {rank} "
                                 "(comm.on_nonfinite='skip' skips such steps instead)")
    if skipped:
        log.warning("step %d: gradient norm is %s: optimizer step skipped", step, float(norm))
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return skipped


def train(config: RunConfig, ctx: rdist.DistContext) -> dict | None:
    """Run the configured job on this rank through :class:`poise.Session`, as a user's script
    would; rank 0 writes the outputs and returns the report."""
    threads = rdist.threads_for(config, ctx.local_world_size)
    torch.set_num_threads(threads)
    seed_everything(config.train.seed, ctx.rank)
    task = build_task_once_per_node(config, ctx)
    tc = config.train
    sampler = build_sampler(config, task, ctx.rank, ctx.world_size)
    # The sampler's steps are micro-batches: an optimizer step takes accum_steps of them.
    total_micro = (config.total_steps * tc.accum_steps if config.total_steps is not None
                   else sampler.steps_in_epochs(tc.epochs or 0))
    optimizer_steps = math.ceil(total_micro / tc.accum_steps)
    warmup = lr_warmup(tc.warmup_steps, optimizer_steps)
    torch.manual_seed(tc.seed)  # the same initial weights everywhere (DDP also broadcasts them)
    model = task.build_model().to(ctx.device)
    freeze(model, tc.frozen_prefixes())
    session = Session(model, sampler=sampler, loss_terms=task.train_targets, balance=config.balance,
                      comm=config.comm, straggler=config.straggler, seed=tc.seed, diagnostics=config.diagnostics,
                      metrics=config.metrics, out_dir=config.out_dir,
                      accum_steps=tc.accum_steps, total_steps=optimizer_steps, lr_warmup_steps=warmup,
                      keep_freed_memory=config.dist.keep_freed_memory)
    ddp = session.model
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, config, task, session.compression_start)
    scheduler = lr_schedule(optimizer, tc.warmup_steps, schedule_span(config, session, optimizer_steps))
    faults = FaultPlan.from_config(config.faults)
    attempt = restart_count()
    start_step, resumed_from = 0, None
    found = resume_point(config, ctx, attempt)
    if found is not None:
        resumed_from, manifest = found

        def throwaway_step() -> None:
            with torch.random.fork_rng(devices=[]):  # leave every RNG as the checkpoint will set it
                task.train_loss(ddp, task.collate([task.train_set[0]]).to(ctx.device)).backward()

        session.settle_buckets(throwaway_step)
        state = checkpoint.load(config, resumed_from, manifest, rank=ctx.rank, world_size=ctx.world_size,
                                model=ddp.module)
        checkpoint.restore(state, model=ddp.module, optimizer=optimizer, scheduler=scheduler, session=session)
        start_step = int(state.shared["step"])
        log.info("resumed from %s at step %d (launcher attempt %d)", resumed_from, start_step, attempt)
    saver = None
    if config.checkpoint.every_steps:
        saver = checkpoint.Checkpointer(config, rank=ctx.rank, world_size=ctx.world_size, store=ctx.store,
                                        attempt=attempt, model=ddp.module)
    samples = SampleLog.open(Path(config.out_dir), ctx, start_step) if config.diagnostics.record_samples else None

    def save(steps_done: int) -> None:
        assert saver is not None
        stall_s = saver.save(checkpoint.capture(step=steps_done, model=ddp.module, optimizer=optimizer,
                                                scheduler=scheduler, session=session, world_size=ctx.world_size,
                                                in_window=steps_done % tc.accum_steps != 0))
        if session.metrics is not None:
            session.metrics.observe_checkpoint(stall_s)
    log.info(
        "training %s: %d params, %d train samples, %d steps, balance %s, codec %s",
        task.name, sum(p.numel() for p in ddp.parameters()), len(task.train_lengths), total_micro,
        config.balance.strategy, config.comm.codec,
    )

    loader = DataLoader(task.train_set, batch_sampler=session.sampler, collate_fn=faults.wrap_collate(task.collate))
    steps_done = start_step
    last_saved = start_step if resumed_from else None
    epoch = session.sampler.epoch

    def run_ends_after_this_batch() -> bool:
        if tc.epochs is None:
            return steps_done + 1 == total_micro
        # the DataLoader takes one batch at a time here (no workers): position is this batch's + 1
        return epoch + 1 == tc.epochs and session.sampler.position == len(session.sampler)

    def run_eval() -> EvalResult:
        return evaluate(ddp.module, task, ctx, max_samples=config.task.eval_max_samples,
                        batch_size=tc.batch_size or task.default_batch_size)

    reached: EvalResult | None = None  # the evaluation that met train.stop_at_eval_loss
    with step_progress(config.diagnostics.progress and ctx.is_main, total_micro) as progress:
        # epochs: every epoch to its end (after an elastic resume, the step count is another one)
        while reached is None and (epoch < tc.epochs if tc.epochs is not None else steps_done < total_micro):
            session.sampler.set_epoch(epoch)  # keeps a resumed epoch's position
            for item in (session.steps(loader) if session.deadline is not None else loader):
                faults.check(ctx.rank, steps_done)
                if session.deadline is not None:
                    step, micro_batches = item  # straggler-tolerant: micro-batches until the deadline
                    for batch in micro_batches:
                        step.backward(task.train_loss(ddp, batch.to(ctx.device)))
                    if step.empty:  # nobody computed anything: a zero gradient, no optimizer step
                        optimizer.zero_grad(set_to_none=True)
                    else:
                        step.skipped = clip_and_step(ddp, optimizer, scheduler, tc.grad_clip_norm, step.index,
                                                     config.comm.on_nonfinite, ctx.rank)
                    step.end()
                    if samples is not None:
                        samples.write(step.index, step.epoch, step.trained)
                else:
                    last = run_ends_after_this_batch()
                    with session.step(sync=True if last else None) as step:
                        if samples is not None:
                            samples.write(step.index, step.epoch, step.indices)
                        step.backward(task.train_loss(ddp, item.to(ctx.device)))
                        if step.sync:
                            step.skipped = clip_and_step(ddp, optimizer, scheduler, tc.grad_clip_norm, step.index,
                                                         config.comm.on_nonfinite, ctx.rank)
                rec = session.last_record  # on CUDA, the step before (its events are read a step late)
                if rec is not None:
                    if rec.samples and not math.isfinite(rec.loss) and config.comm.on_nonfinite == "error":
                        raise FloatingPointError(
                            f"training loss is {rec.loss} at step {rec.step} on rank {ctx.rank} "
                            "(comm.on_nonfinite='skip' skips such steps instead)"
                        )
                    rate = rec.samples / rec.step_s if rec.step_s > 0 else 0.0
                    progress.update(rec.step, f"loss {rec.loss:.3f}  {rate * ctx.world_size:.0f} samples/s")
                    if ctx.is_main and (rec.step + 1) % config.diagnostics.log_every_steps == 0:
                        log.info("step %d/%d loss %.4f step %.0f ms", rec.step + 1, total_micro, rec.loss,
                                 rec.step_s * 1e3)
                steps_done += 1
                if saver is not None and saver.due(steps_done):
                    save(steps_done)
                    last_saved = steps_done
                if tc.eval_every and steps_done % (tc.eval_every * tc.accum_steps) == 0 and steps_done < total_micro:
                    result = session.evaluate(run_eval)
                    if tc.stop_at_eval_loss is not None and result.loss <= tc.stop_at_eval_loss:
                        log.info("step %d: eval loss %.4f reached train.stop_at_eval_loss=%g: stopping",
                                 steps_done // tc.accum_steps, result.loss, tc.stop_at_eval_loss)
                        reached = result
                        break
                if tc.epochs is None and steps_done >= total_micro:
                    break
            epoch += 1
    if saver is not None:
        if last_saved != steps_done:
            save(steps_done)  # the end of the run is always saved
        saver.wait()
    if samples is not None:
        samples.close()
    if resumed_from is not None and steps_done == start_step:
        # resumed from the run's final checkpoint (the failure came after it, in evaluation or
        # the report): no step ran in this attempt, so there is nothing to report
        log.warning("resumed from %s, the run's final checkpoint: nothing left to train", resumed_from)
        return None

    if config.comm.local_first:
        # the ranks' weights differ by their unsent residuals: evaluate the weights rank 0 saved
        for tensor in ddp.module.state_dict().values():
            dist.broadcast(tensor, src=0)
    result = reached if reached is not None else session.evaluate(run_eval)
    report = session.finish({
        "task": task.name,
        "loss_unit": result.unit,
        "eval_loss": result.loss,
        "eval_accuracy": result.accuracy,
        "eval_count": result.count,
        "stopped_at_eval_loss": reached is not None,  # train.stop_at_eval_loss was met before the last step
        "variance_frozen_after": optimizer.param_groups[0]["freeze_after"],  # optimizer steps; None: never
        "restarts": attempt,
        "resumed_from": resumed_from,
        "first_step": start_step,
        "checkpoints": saver.report() if saver is not None else None,
        "config": config_mod.to_dict(config),
    }, loss_scale=task.loss_in_unit(1.0))
    if report is not None:
        log.info(
            "done: eval loss %.4f %s, accuracy %.2f%%, %.1f samples/s, balance %.3f",
            result.loss, result.unit, 100 * result.accuracy, report["throughput_samples_per_s"], report["balance"],
        )
    return report


@record
def main(argv: list[str] | None = None) -> int:
    """Worker entry point; errors propagate so torchrun reports them with this rank's traceback."""
    return entry.run_config_job(argv, "poise.runtime.worker", "train", train)


if __name__ == "__main__":
    entry.leave(main())
