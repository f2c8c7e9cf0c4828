"""The per-rank entry point: ``torchrun ... -m poise.runtime.worker --config DIR/config.toml``.

``poise train`` starts this module through torch's elastic launcher; users can start it
with a plain ``torchrun`` just as well. It reads the resolved config, joins the process
group, builds the task, the DDP model (with the timing probe on its communication hook),
the data schedule and the optimizer, runs the steps, evaluates, and rank 0 writes
``report.json``, ``trace.json`` and ``timeline.png`` into the config's ``out_dir``.
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from poise import checkpoint, optim
from poise import config as config_mod
from poise.comm import builder as comm_builder
from poise.comm.probe import BucketProbe, instrumented
from poise.comm.settle import settle_buckets
from poise.config import RunConfig
from poise.diagnostics import report as report_mod
from poise.diagnostics.timeline import Timeline, write_chrome_trace
from poise.files import write_json_atomic
from poise.log import step_progress
from poise.runtime import dist as rdist
from poise.runtime import entry
from poise.runtime.data import build_data_plan, loss_scale
from poise.runtime.evaluate import evaluate
from poise.runtime.faults import FaultPlan, restart_count
from poise.runtime.samples import SampleLog
from poise.runtime.slowdown import Slowdown, apply_slowdown
from poise.runtime.step import train_step
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


def lr_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to 10% of the peak at ``total_steps``."""
    warmup = lr_warmup(warmup_steps, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def wrap_model(
    config: RunConfig, task: Task, ctx: rdist.DistContext, slowdown: Slowdown, compression_start: int
) -> tuple[DistributedDataParallel, BucketProbe, Any]:
    """The task's model in DDP, with the configured comm hook behind the timing probe; the
    hook compresses from step ``compression_start`` on.

    Returns ``(ddp, probe, comm_state)``; the comm state counts bytes and codec seconds.
    """
    torch.manual_seed(config.train.seed)  # the same initial weights everywhere (DDP also broadcasts them)
    model = task.build_model().to(ctx.device)
    freeze(model, config.train.frozen_prefixes())
    comm_builder.check_backend(config.comm, ctx.backend)
    bucket_cap_mb = config.comm.bucket_mb
    if comm_builder.requires_single_bucket(config.comm):
        bucket_cap_mb = 2 * sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        log.info("comm.codec=%r needs a single bucket on gloo: bucket size %.1f MB instead of comm.bucket_mb",
                 config.comm.codec, bucket_cap_mb)
    ddp = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, bucket_cap_mb=bucket_cap_mb
    )
    probe = BucketProbe()  # host clock: this step times with perf_counter
    hook, comm_state = comm_builder.build(config.comm, start_step=compression_start)
    # order matters: the emulated slowness must happen before the probe reads the clock
    ddp.register_comm_hook(comm_state, slowdown.wrap_hook(instrumented(hook, probe)))
    return ddp, probe, comm_state


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


def train(config: RunConfig, ctx: rdist.DistContext) -> dict | None:
    """Run the configured job on this rank; rank 0 writes the outputs and returns the report."""
    started = time.perf_counter()
    threads = rdist.threads_for(config, ctx.local_world_size)
    torch.set_num_threads(threads)
    seed_everything(config.train.seed, ctx.rank)
    task = build_task_once_per_node(config, ctx)
    tc = config.train
    slowdown = apply_slowdown(ctx.rank, config.balance.rank_speeds(), config.balance.slowdown_method, threads)
    data = build_data_plan(config, task, ctx)
    total_steps = data.total_steps()
    optimizer_steps = math.ceil(total_steps / tc.accum_steps)
    compression_start = config.comm.compression_start(optimizer_steps, lr_warmup(tc.warmup_steps, optimizer_steps))
    ddp, probe, comm_state = wrap_model(config, task, ctx, slowdown, compression_start)
    trainable = [p for p in ddp.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable, config, task, compression_start)
    scheduler = lr_schedule(optimizer, tc.warmup_steps, optimizer_steps)
    timeline = Timeline(ctx.rank, ctx.world_size, config.diagnostics.gather_every_steps, ctx.device)
    faults = FaultPlan.from_config(config.faults)
    attempt = restart_count()
    start_step, resumed_from = 0, None
    found = resume_point(config, ctx, attempt)
    if found is not None:
        resumed_from, manifest = found

        def throwaway_step() -> None:
            with torch.random.fork_rng(devices=[]):  # leave every RNG as the checkpoint will set it
                task.train_loss(ddp, task.collate([task.train_set[0]]).to(ctx.device)).backward()

        settle_buckets(ddp, comm_state, throwaway_step)
        state = checkpoint.load(config, resumed_from, manifest, rank=ctx.rank, world_size=ctx.world_size,
                                model=ddp.module)
        checkpoint.restore(state, model=ddp.module, optimizer=optimizer, scheduler=scheduler, data=data,
                           comm_state=comm_state)
        start_step = int(state.shared["step"])
        log.info("resumed from %s at step %d (launcher attempt %d)", resumed_from, start_step, attempt)
    saver = None
    if config.checkpoint.every_steps:
        saver = checkpoint.Checkpointer(config, rank=ctx.rank, world_size=ctx.world_size, store=ctx.store,
                                        attempt=attempt, model=ddp.module)
    samples = SampleLog.open(Path(config.out_dir), ctx, start_step) if config.diagnostics.record_samples else None

    def save(steps_done: int) -> None:
        assert saver is not None
        saver.save(checkpoint.capture(step=steps_done, model=ddp.module, optimizer=optimizer, scheduler=scheduler,
                                      data=data, comm_state=comm_state, world_size=ctx.world_size,
                                      in_window=steps_done % tc.accum_steps != 0))
    log.info(
        "training %s: %d params, %d train samples, %d steps, balance %s, codec %s",
        task.name, sum(p.numel() for p in ddp.parameters()), len(task.train_lengths), total_steps,
        config.balance.strategy, config.comm.codec,
    )

    steps_done = start_step
    last_saved = start_step if resumed_from else None
    with step_progress(config.diagnostics.progress and ctx.is_main, total_steps) as progress:
        for step, batches in enumerate(data.steps(start_step), start=start_step):
            faults.check(ctx.rank, step)
            mine = batches[ctx.rank]
            if samples is not None:
                samples.write(step, data.schedule.epoch, mine)
            rec = train_step(
                step=step, model=ddp, task=task, indices=mine,
                loss_scale=loss_scale(batches, ctx.rank, task.train_targets), optimizer=optimizer,
                scheduler=scheduler, probe=probe, comm_state=comm_state, slowdown=slowdown,
                grad_clip_norm=tc.grad_clip_norm, device=ctx.device, accum_steps=tc.accum_steps,
                last_micro=(step + 1) % tc.accum_steps == 0 or step + 1 == total_steps,
            )
            if not math.isfinite(rec.loss) and config.comm.on_nonfinite == "error":
                raise FloatingPointError(
                    f"training loss is {rec.loss} at step {step} on rank {ctx.rank} "
                    "(comm.on_nonfinite='skip' skips such steps instead)"
                )
            timeline.record(rec)
            if data.partitioner is not None:
                data.partitioner.observe(task.train_lengths[mine], rec.compute_s)
                if step + 1 < total_steps and data.partitioner.due(step + 1):
                    data.partitioner.replan(step + 1)
            rate = rec.samples / rec.step_s if rec.step_s > 0 else 0.0
            progress.update(step, f"loss {rec.loss:.3f}  {rate * ctx.world_size:.0f} samples/s")
            if ctx.is_main and (step + 1) % config.diagnostics.log_every_steps == 0:
                log.info("step %d/%d loss %.4f step %.0f ms", step + 1, total_steps, rec.loss, rec.step_s * 1e3)
            steps_done = step + 1
            if saver is not None and saver.due(steps_done):
                save(steps_done)
                last_saved = steps_done
    if saver is not None:
        if last_saved != steps_done:
            save(steps_done)  # the end of the run is always saved
        saver.wait()
    if samples is not None:
        samples.close()
    timeline.flush()

    if config.comm.local_first:
        # the ranks' weights differ by their unsent residuals: evaluate the weights rank 0 saved
        for tensor in ddp.module.state_dict().values():
            dist.broadcast(tensor, src=0)
    result = evaluate(ddp.module, task, ctx, max_samples=config.task.eval_max_samples,
                      batch_size=tc.batch_size or task.default_batch_size)
    slowdowns: list[dict] = [{}] * ctx.world_size  # emulated heterogeneity of every rank
    dist.all_gather_object(slowdowns, {"speed": slowdown.speed, "method": slowdown.method})
    if not ctx.is_main:
        return None
    table = timeline.table()
    report = {
        "task": task.name,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "wall_s": time.perf_counter() - started,
        **report_mod.summarize(table, loss_scale=task.loss_in_unit(1.0)),
        "loss_unit": result.unit,
        "eval_loss": result.loss,
        "eval_accuracy": result.accuracy,
        "eval_count": result.count,
        "balance_strategy": config.balance.strategy,
        "codec": config.comm.codec,
        "compression_start_step": compression_start,  # optimizer steps sent uncompressed first
        "variance_frozen_after": optimizer.param_groups[0]["freeze_after"],  # optimizer steps; None: never
        "replans": [e.__dict__ for e in data.partitioner.history] if data.partitioner else [],
        "emulated_slowdown": slowdowns,  # speed 1.0, method 'none' = not slowed
        "restarts": attempt,
        "resumed_from": resumed_from,
        "first_step": start_step,
        "checkpoints": saver.report() if saver is not None else None,
        "config": config_mod.to_dict(config),
    }
    write_outputs(Path(config.out_dir), report, table, plot=config.diagnostics.plot)
    log.info(
        "done: eval loss %.4f %s, accuracy %.2f%%, %.1f samples/s, balance %.3f",
        result.loss, result.unit, 100 * result.accuracy, report["throughput_samples_per_s"], report["balance"],
    )
    return report


def write_outputs(out: Path, report: dict, table: np.ndarray, *, plot: bool) -> None:
    """Rank 0: report.json, trace.json and (optionally) timeline.png from the gathered ``table``."""
    write_json_atomic(out / "report.json", report)
    write_chrome_trace(table, out / "trace.json")
    if plot:
        report_mod.plot_timeline(table, out / "timeline.png")


@record
def main(argv: list[str] | None = None) -> int:
    """Worker entry point; errors propagate so torchrun reports them with this rank's traceback."""
    return entry.run_config_job(argv, "poise.runtime.worker", "train", train)


if __name__ == "__main__":
    entry.leave(main())
