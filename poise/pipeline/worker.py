"""Per-rank entry of ``poise pipeline``: ``torchrun ... -m poise.pipeline.worker --config FILE``.

Every rank builds the same code-lm model (same seed) and the same batches. Rank 0 profiles
the model's layers (embedding, blocks, output head with the loss) on a real micro-batch and
broadcasts the numbers; every rank then computes the same plan (:mod:`poise.pipeline.stages`)
and keeps only its own stage's layers. The stages train with torch's GPipe or 1F1B
schedule, each measuring its own compute per step; rank 0 gathers those and writes
``report.json`` with the measured balance next to the predicted one.

Batches are padded to ``max_seq_len − 1`` tokens, so every step has the shapes the stages
were set up with and the profile was taken on (padding is causal-masked and ignored by the
loss, so the loss equals the unpadded batch's).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from poise import config as config_mod
from poise.balance.metrics import balance
from poise.balance.profile import LayerProfile, profile_layers
from poise.config import RunConfig
from poise.files import write_json_atomic
from poise.pipeline.stage import StageRunner, TokenLoss, stage_layers
from poise.pipeline.stages import StagePlan, plan_stages
from poise.runtime import dist as rdist
from poise.tasks.base import IGNORE_INDEX, Batch, Task
from poise.train import entry
from poise.train.data import build_task_once_per_node
from poise.train.recipe import lr_schedule, make_optimizer, seed_everything

# By name: run as `-m poise.pipeline.worker`, __name__ would be "__main__", outside "poise".
log = logging.getLogger("poise.pipeline.worker")


class FixedLengthBatches:
    """The same batches on every rank: a seeded permutation per epoch, padded to ``length``."""

    def __init__(self, task: Task, batch_size: int, length: int, seed: int) -> None:
        self.task = task
        self.batch_size = batch_size
        self.length = length
        self.seed = seed
        self.num_samples = len(task.train_lengths)
        if batch_size > self.num_samples:
            raise ValueError(f"train.batch_size={batch_size} exceeds the {self.num_samples} training samples")
        self.per_epoch = self.num_samples // batch_size

    def batch(self, step: int) -> Batch:
        epoch, index = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        chosen = order[index * self.batch_size : (index + 1) * self.batch_size]
        return pad_batch(self.task.collate([self.task.train_set[int(i)] for i in chosen]), self.length)


def first_micro_batch(batches: FixedLengthBatches, num_micro_batches: int) -> Batch:
    """The first micro-batch of step 0 (torch's pipelining cuts a batch into chunks of ⌈B / m⌉ rows)."""
    first = batches.batch(0)
    rows = math.ceil(batches.batch_size / num_micro_batches)
    return Batch(first.inputs[:rows], first.targets[:rows], rows, 0, 0)


def pad_batch(batch: Batch, length: int) -> Batch:
    """Right-pad inputs (byte 0) and targets (ignored) to ``length`` tokens."""
    extra = length - batch.inputs.shape[1]
    if extra < 0:
        raise ValueError(f"batch of {batch.inputs.shape[1]} tokens is longer than the pipeline length {length}")
    rows = batch.inputs.shape[0]
    return Batch(
        inputs=torch.cat([batch.inputs, batch.inputs.new_zeros(rows, extra)], dim=1),
        targets=torch.cat([batch.targets, batch.targets.new_full((rows, extra), IGNORE_INDEX)], dim=1),
        num_samples=batch.num_samples,
        num_tokens=batch.num_tokens,
        num_padded_tokens=rows * (length + 1),
    )


def profile_micro_batch(layers: list[torch.nn.Module], names: list[str], micro: Batch, *, repeats: int,
                        warmup: int) -> LayerProfile:
    """Profile the layers on one micro-batch, the loss counted in the last layer (the last stage computes it)."""
    loss = TokenLoss()
    loss.begin_step(micro.targets)
    return profile_layers(layers, micro.inputs, names=names, loss_fn=lambda out: loss(out, micro.targets),
                          repeats=repeats, warmup=warmup)


def profile_on_rank0(layers: list[torch.nn.Module], names: list[str], micro: Batch, config: RunConfig) -> LayerProfile:
    """Rank 0 profiles (the others wait), then every rank gets the same numbers."""
    holder: list[dict | None] = [None]
    if dist.get_rank() == 0:
        profile = profile_micro_batch(layers, names, micro, repeats=config.pipeline.profile_repeats,
                                      warmup=config.pipeline.profile_warmup)
        holder[0] = profile.as_dict()
    dist.broadcast_object_list(holder, src=0)
    assert holder[0] is not None
    return LayerProfile(**holder[0])


def check_config(config: RunConfig, batch_size: int | None) -> None:
    """What a pipeline run needs beyond the config's own checks (``batch_size``: samples per
    step, None when not known yet).

    Raises:
        ValueError: another task than code-lm, epochs or a token budget, or fewer samples per
            step than micro-batches.
    """
    if config.task.name != "code-lm":
        raise ValueError(f"poise pipeline splits code-lm's transformer; task.name={config.task.name!r} has no layers")
    if config.train.epochs is not None or config.train.batch_tokens is not None:
        raise ValueError("poise pipeline runs train.steps of train.batch_size samples; "
                         "train.epochs and train.batch_tokens are not supported")
    if batch_size is not None and batch_size < config.pipeline.micro_batches:
        raise ValueError(f"train.batch_size={batch_size} cannot be cut into pipeline.micro_batches="
                         f"{config.pipeline.micro_batches}: give a batch of at least that many samples")
    if config.task.num_layers + 2 < config.dist.nproc:
        raise ValueError(f"{config.dist.nproc} stages need at least as many layers, but code-lm has "
                         f"{config.task.num_layers + 2} (embedding, {config.task.num_layers} blocks, head)")


def layer_names(num_blocks: int) -> list[str]:
    return ["embedding", *(f"block{i}" for i in range(num_blocks)), "head"]


def train_pipeline(config: RunConfig, ctx: rdist.DistContext) -> dict | None:
    """Profile, plan, train this rank's stage; rank 0 writes and returns the report."""
    started = time.perf_counter()
    torch.set_num_threads(rdist.threads_for(config, ctx.local_world_size))
    seed_everything(config.train.seed, ctx.rank)
    check_config(config, config.train.batch_size)
    task = build_task_once_per_node(config, ctx)
    pc, tc = config.pipeline, config.train
    batch_size = tc.batch_size or task.default_batch_size
    check_config(config, batch_size)
    total_steps = config.total_steps or 0
    model = task.build_model()  # seeded: identical on every rank
    layers = model.pipeline_layers()  # type: ignore[operator]
    names = layer_names(len(layers) - 2)
    batches = FixedLengthBatches(task, batch_size, config.task.max_seq_len - 1, tc.seed)
    micro = first_micro_batch(batches, pc.micro_batches)
    profile = profile_on_rank0(layers, names, micro, config)
    in_flight = pc.micro_batches if pc.schedule == "gpipe" else min(pc.micro_batches, ctx.world_size)
    plan = plan_stages(profile, ctx.world_size, method=pc.partition, num_micro_batches=pc.micro_batches,
                       batch_size=batch_size, in_flight_micro_batches=in_flight,
                       link_bytes_per_s=pc.link_bandwidth_bytes_per_s, memory_cap_bytes=pc.memory_cap_bytes)
    if ctx.is_main:
        log.info("plan (%s): %s, predicted balance %.3f", plan.method,
                 " | ".join("+".join(s) for s in plan.stage_layers), plan.compute_balance)
    module = stage_layers(layers, plan.boundaries, ctx.rank)
    del model, layers  # this rank keeps its own stage only
    optimizer = make_optimizer(module.parameters(), config, task)
    scheduler = lr_schedule(optimizer, tc.warmup_steps, total_steps)
    runner = StageRunner(module, stage_index=ctx.rank, num_stages=ctx.world_size, schedule=pc.schedule,
                         num_micro_batches=pc.micro_batches, optimizer=optimizer,
                         grad_clip_norm=tc.grad_clip_norm, device=ctx.device)
    rows = []
    for step in range(total_steps):
        batch = batches.batch(step)
        rec = runner.step(batch.inputs if runner.is_first else None, batch.targets if runner.is_last else None)
        scheduler.step()
        loss = None if rec.loss is None else task.loss_in_unit(rec.loss)
        rows.append({"compute_s": rec.compute_s, "step_s": rec.step_s, "loss": loss, "tokens": batch.num_tokens})
        if runner.is_last and rec.loss is not None and not math.isfinite(rec.loss):
            raise FloatingPointError(f"training loss is {rec.loss} at step {step}")
        if ctx.is_main and (step + 1) % config.diagnostics.log_every_steps == 0:
            log.info("step %d/%d: stage 0 compute %.0f ms, step %.0f ms", step + 1, total_steps,
                     rec.compute_s * 1e3, rec.step_s * 1e3)
    gathered: list[list[dict]] = [[] for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, rows)
    if not ctx.is_main:
        return None
    report = build_report(config, plan, profile, gathered, loss_unit=task.loss_unit,
                          wall_s=time.perf_counter() - started)
    write_json_atomic(Path(config.out_dir) / "report.json", report)
    log.info("done: measured balance %.3f vs predicted %.3f", report["measured_balance"], report["predicted_balance"])
    return report


def build_report(config: RunConfig, plan: StagePlan, profile: LayerProfile, per_stage: list[list[dict]],
                 *, loss_unit: str, wall_s: float) -> dict:
    """Measured vs predicted, per stage and overall, from every stage's per-step rows."""
    skip = min(config.pipeline.warmup_steps, max(0, len(per_stage[0]) - 1))
    measured = [statistics.median(r["compute_s"] for r in rows[skip:]) for rows in per_stage]
    step_s = statistics.median(max(rows[i]["step_s"] for rows in per_stage) for i in range(skip, len(per_stage[0])))
    per_step_balance = [balance([rows[i]["compute_s"] for rows in per_stage]) for i in range(skip, len(per_stage[0]))]
    losses = [r["loss"] for r in per_stage[-1]]
    tokens = statistics.mean(r["tokens"] for r in per_stage[0])
    predicted_balance = plan.compute_balance
    measured_balance = balance(measured)
    return {
        "task": config.task.name,
        "num_stages": len(per_stage),
        "schedule": config.pipeline.schedule,
        "micro_batches": config.pipeline.micro_batches,
        "steps": len(per_stage[0]),
        "warmup_steps_skipped": skip,
        "wall_s": wall_s,
        "plan": plan.as_dict(),
        "predicted_stage_s": plan.compute_s,
        "measured_stage_s": measured,
        "predicted_balance": predicted_balance,
        "measured_balance": measured_balance,
        "balance_gap": abs(measured_balance - predicted_balance),
        "measured_balance_per_step_median": statistics.median(per_step_balance),
        "step_s": step_s,
        "throughput_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "loss_curve": losses,
        "loss_unit": loss_unit,
        "profile": profile.as_dict(),
        "config": config_mod.to_dict(config),
    }


@record
def main(argv: list[str] | None = None) -> int:
    """Worker entry point; errors propagate so torchrun reports them with this rank's traceback."""
    return entry.run_config_job(argv, "poise.pipeline.worker", "pipeline", train_pipeline)


if __name__ == "__main__":
    entry.leave(main())
