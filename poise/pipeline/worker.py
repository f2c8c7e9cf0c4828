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

With ``pipeline.dp_size`` N > 1 the world is N replicas of the pipeline
(:mod:`poise.pipeline.replicas`): every replica runs the same plan on its share of each step's
N x ``train.batch_size`` samples, each stage in DDP over its replicas with ``comm.codec``, and
the report adds each replica's figures (``per_dp_rank``) and the reduction's bytes and seconds.

With ``train.eval_every`` the pipeline evaluates the held-out subset ``poise train`` evaluates
(:mod:`poise.pipeline.evaluate`) every that many steps and at the end, stops at
``train.stop_at_eval_loss``, and reports ``eval_curve`` and ``eval_loss`` under ``poise train``'s
names (so do ``median_step_s``, ``balance``, ``memory`` and
``comm_inter_node_wire_bytes_per_step``: ``poise bench parallel`` reads them); without it,
training loss only, as before.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from poise import config as config_mod
from poise.balance.metrics import balance
from poise.balance.profile import LayerProfile, profile_layers
from poise.comm import registry
from poise.config import RunConfig
from poise.files import write_json_atomic
from poise.pipeline.batches import FixedLengthBatches, first_micro_batch
from poise.pipeline.evaluate import evaluate
from poise.pipeline.replicas import ReplicaGrid, ReplicaSync, check_comm, make_grid, replica_shares, replica_weight
from poise.pipeline.stage import StageRunner, TokenLoss, stage_examples, stage_layers
from poise.pipeline.stages import StagePlan, plan_stages
from poise.runtime import dist as rdist
from poise.runtime import memory
from poise.tasks.base import IGNORE_INDEX, Batch
from poise.train import entry
from poise.train.data import build_task_once_per_node
from poise.train.evaluate import eval_indices
from poise.train.recipe import lr_schedule, lr_warmup, make_optimizer, seed_everything

# By name: run as `-m poise.pipeline.worker`, __name__ would be "__main__", outside "poise".
log = logging.getLogger("poise.pipeline.worker")
# what the launcher imports before it forks the workers (poise.launch.elastic): the replicas'
# DDP imports torch._dynamo, about 2.5 s of CPU in each worker otherwise
FORK_PRELOAD = ("torch._dynamo",)


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
    step, None when not known yet). Stages are the world (``dist.nproc`` x nodes) divided by
    ``pipeline.dp_size``.

    Raises:
        ValueError: another task than code-lm, packed rows, epochs or a token budget, fewer samples per
            step (per replica) than micro-batches, a world that ``pipeline.dp_size`` does not
            divide, or (with replicas) comm settings DDP over them cannot run.
    """
    if config.task.name != "code-lm":
        raise ValueError(f"poise pipeline splits code-lm's transformer; task.name={config.task.name!r} has no layers")
    if config.train.epochs is not None or config.train.batch_tokens is not None:
        raise ValueError("poise pipeline runs train.steps of train.batch_size samples; "
                         "train.epochs and train.batch_tokens are not supported")
    if config.task.packed:
        raise ValueError("task.packed=true: poise pipeline's stages take padded samples, not packed rows with "
                         "attention per document; train packed rows with poise train")
    if config.parallel.sharded:
        raise ValueError(f"parallel.mode={config.parallel.mode!r} shards a whole model with FSDP2 (poise train); "
                         "poise pipeline replicates each stage with DDP: use --dp N")
    dp, world = config.pipeline.dp_size, config.max_world_size()
    if world % dp:
        raise ValueError(f"pipeline.dp_size={dp} does not divide the {world} workers into equal pipelines: "
                         "give --stages P --dp N (P x N workers)")
    m = config.pipeline.micro_batches
    if batch_size is not None and batch_size < m and dp == 1:
        raise ValueError(f"train.batch_size={batch_size} cannot be cut into pipeline.micro_batches={m}: "
                         "give a batch of at least that many samples")
    # torch's pipelining sizes every micro-batch's buffers from the first: a shorter last one
    # would stop the last stage with a shape error in its loss
    if batch_size is not None and dp == 1 and batch_size % m:
        raise ValueError(f"train.batch_size={batch_size} cannot be cut into pipeline.micro_batches={m} equal "
                         f"micro-batches: give a multiple of {m}")
    if batch_size is not None and dp > 1 and (batch_size < m or batch_size * dp % m):
        raise ValueError(f"train.batch_size={batch_size} per replica ({batch_size * dp} samples per step over "
                         f"pipeline.dp_size={dp} replicas) cannot be cut into whole micro-batches: each replica "
                         f"runs pipeline.micro_batches={m} equal ones, so give at least {m} per replica and a "
                         f"multiple of {m} per step")
    stages = world // dp
    if config.task.num_layers + 2 < stages:
        raise ValueError(f"{stages} stages need at least as many layers, but code-lm has "
                         f"{config.task.num_layers + 2} (embedding, {config.task.num_layers} blocks, head)")
    if dp > 1:
        check_comm(config.comm, "gloo" if config.dist.backend == "auto" else config.dist.backend)


def layer_names(num_blocks: int) -> list[str]:
    return ["embedding", *(f"block{i}" for i in range(num_blocks)), "head"]


def train_pipeline(config: RunConfig, ctx: rdist.DistContext) -> dict | None:
    """Profile, plan, train this rank's stage (evaluating every ``train.eval_every`` steps, if
    set, and then at the end); rank 0 writes and returns the report."""
    started = time.perf_counter()
    torch.set_num_threads(rdist.threads_for(config, ctx.local_world_size))
    seed_everything(config.train.seed, ctx.rank)
    check_config(config, config.train.batch_size)
    task = build_task_once_per_node(config, ctx)
    pc, tc = config.pipeline, config.train
    check_config(config, tc.batch_size or task.default_batch_size)
    # train.batch_size is per data-parallel rank, as in poise train: a step is dp_size times it
    batch_size = (tc.batch_size or task.default_batch_size) * pc.dp_size
    total_steps = config.total_steps or 0
    grid = make_grid(pc.dp_size)
    stages = grid.pp_size
    length = config.task.max_seq_len - 1
    shares = replica_shares(batch_size, length, grid.dp_size, pc.micro_batches)
    share = torch.from_numpy(shares[grid.dp_rank])
    model = task.build_model()  # seeded: identical on every rank
    layers = model.pipeline_layers()  # type: ignore[operator]
    names = layer_names(len(layers) - 2)
    batches = FixedLengthBatches(task, batch_size, length, tc.seed)
    micro = first_micro_batch(batches, pc.micro_batches, samples=len(shares[0]))
    profile = profile_on_rank0(layers, names, micro, config)
    in_flight = pc.micro_batches if pc.schedule == "gpipe" else min(pc.micro_batches, stages)
    plan = plan_stages(profile, stages, method=pc.partition, num_micro_batches=pc.micro_batches,
                       batch_size=len(shares[0]), in_flight_micro_batches=in_flight,
                       link_bytes_per_s=pc.link_bandwidth_bytes_per_s, memory_cap_bytes=pc.memory_cap_bytes)
    if ctx.is_main:
        log.info("plan (%s): %s, predicted balance %.3f%s", plan.method,
                 " | ".join("+".join(s) for s in plan.stage_layers), plan.compute_balance,
                 f", {grid.dp_size} replicas" if grid.dp_size > 1 else "")
    module = stage_layers(layers, plan.boundaries, grid.pp_rank)
    example = stage_examples(layers, plan.boundaries, grid.pp_rank,
                             batches.batch(0).inputs[share][: len(share) // pc.micro_batches])
    del model, layers  # this rank keeps its own stage only
    sync, compression_start, span = None, None, tc.schedule_steps or total_steps
    if grid.dp_group is not None:
        compression_start = registry.compression_start(config.comm, total_steps, lr_warmup(tc.warmup_steps,
                                                                                            total_steps))
        sync = ReplicaSync(module, config.comm, group=grid.dp_group, backend=ctx.backend,
                           compression_start=compression_start, device=ctx.device)
        if registry.codec(config.comm.codec).lossy:  # each lossy step is worth less: the whole run (train/recipe)
            span = total_steps
    optimizer = make_optimizer(module.parameters(), config, task, compression_start)
    scheduler = lr_schedule(optimizer, tc.warmup_steps, span)
    # DDP needs torch's shape metadata given (see StageRunner's example); alone, torch infers it
    runner = StageRunner(module if sync is None else sync.model, stage_index=grid.pp_rank, num_stages=stages,
                         schedule=pc.schedule, num_micro_batches=pc.micro_batches, optimizer=optimizer,
                         grad_clip_norm=tc.grad_clip_norm, device=ctx.device, group=grid.pp_group,
                         example=None if sync is None else example)
    p2p_bytes, dp_crosses = crossings(grid, ctx.local_world_size, example, pc.micro_batches)
    subset = eval_indices(len(task.eval_set), config.task.eval_max_samples)

    def run_eval() -> float:
        loss_sum, count = evaluate(runner, task, subset, batch_size=batch_size, length=length, shares=shares,
                                   dp_rank=grid.dp_rank)
        return task.loss_in_unit(loss_sum / max(count, 1))

    rows: list[dict] = []
    curve: list[dict] = []
    eval_s, reached, train_started = 0.0, False, time.perf_counter()
    for step in range(total_steps):
        batch = batches.batch(step)
        weight = replica_weight(batch.targets, shares, grid.dp_rank)
        inputs, targets = batch.inputs[share], batch.targets[share]
        if sync is not None:
            sync.begin_step()
        rec = runner.step(inputs if runner.is_first else None, targets if runner.is_last else None, weight)
        scheduler.step()
        loss = None if rec.loss is None else task.loss_in_unit(rec.loss)
        row = {"compute_s": rec.compute_s, "step_s": rec.step_s, "loss": loss, "tokens": batch.num_tokens,
               "samples": len(share), "targets": int((targets != IGNORE_INDEX).sum()), "weight": weight,
               "inter_node_bytes": p2p_bytes}
        if sync is not None:
            traffic = sync.end_step()
            # the stage's last backward waited for its replicas' buckets: that is no compute of its own
            row.update(compute_s=max(0.0, rec.compute_s - traffic.exposed_s), raw_bytes=traffic.raw_bytes,
                       wire_bytes=traffic.wire_bytes, dp_comm_s=traffic.comm_s, dp_exposed_s=traffic.exposed_s,
                       inter_node_bytes=p2p_bytes + (traffic.wire_bytes if dp_crosses else 0))
        rows.append(row)
        if runner.is_last and rec.loss is not None and not math.isfinite(rec.loss):
            raise FloatingPointError(f"training loss is {rec.loss} at step {step}")
        if ctx.is_main and (step + 1) % config.diagnostics.log_every_steps == 0:
            log.info("step %d/%d: stage 0 compute %.0f ms, step %.0f ms", step + 1, total_steps,
                     rec.compute_s * 1e3, rec.step_s * 1e3)
        if tc.eval_every and (step + 1) % tc.eval_every == 0 and step + 1 < total_steps:
            at = time.perf_counter()
            curve.append({"step": step + 1, "train_s": at - train_started - eval_s, "loss": run_eval()})
            eval_s += time.perf_counter() - at
            reached = tc.stop_at_eval_loss is not None and curve[-1]["loss"] <= tc.stop_at_eval_loss
            if reached:  # the same on every rank: the loss is summed over the world
                log.info("step %d: eval loss %.4f reached train.stop_at_eval_loss=%g: stopping", step + 1,
                         curve[-1]["loss"], tc.stop_at_eval_loss)
                break
    if tc.eval_every and not reached:  # evaluations only when asked for (the pipeline's report is its balance)
        at = time.perf_counter()
        curve.append({"step": len(rows), "train_s": at - train_started - eval_s, "loss": run_eval()})
    mine = {"rows": rows, "memory": memory.summary(None, memory.state_bytes(module, optimizer))}
    gathered: list[dict] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(gathered, mine)
    if not ctx.is_main:
        return None
    report = build_report(config, plan, profile, [g["rows"] for g in gathered], loss_unit=task.loss_unit,
                          wall_s=time.perf_counter() - started, grid=grid)
    report.update(eval_curve=curve, eval_loss=curve[-1]["loss"] if curve else None, stopped_at_eval_loss=reached,
                  memory=[g["memory"] for g in gathered])
    write_json_atomic(Path(config.out_dir) / "report.json", report)
    log.info("done: measured balance %.3f vs predicted %.3f", report["measured_balance"], report["predicted_balance"])
    return report


def crossings(grid: ReplicaGrid, local_world_size: int, example: tuple[torch.Tensor, torch.Tensor],
              micro_batches: int) -> tuple[int, bool]:
    """What this rank sends between nodes (nodes hold ``local_world_size`` consecutive ranks):
    the bytes of its activations and input gradients per step that go to a stage on another
    node, and whether its ``dp`` group spans nodes (then all its DDP traffic does)."""
    def node(rank: int) -> int:
        return rank // local_world_size

    me = grid.rank_of(grid.dp_rank, grid.pp_rank)
    sent = 0
    inputs, outputs = example
    if grid.pp_rank < grid.pp_size - 1 and node(me + 1) != node(me):
        sent += micro_batches * outputs.numel() * outputs.element_size()
    if grid.pp_rank > 0 and inputs.is_floating_point() and node(me - 1) != node(me):
        sent += micro_batches * inputs.numel() * inputs.element_size()
    replicas = {node(grid.rank_of(d, grid.pp_rank)) for d in range(grid.dp_size)}
    return sent, len(replicas) > 1


def build_report(config: RunConfig, plan: StagePlan, profile: LayerProfile, per_rank: list[list[dict]],
                 *, loss_unit: str, wall_s: float, grid: ReplicaGrid | None = None) -> dict:
    """Measured vs predicted, per stage and overall, from every rank's per-step rows (in rank
    order; ``grid`` places them: one replica, the ranks are the stages, if None).

    With replicas, a stage's measured seconds are its slowest replica's (the all-reduce makes
    the others wait for it), the loss is the mean of the replicas' weighted losses (the whole
    step's mean over its real target tokens), and ``per_dp_rank`` holds each replica's own.
    """
    dp = grid.dp_size if grid is not None else 1
    stages = len(per_rank) // dp
    steps = len(per_rank[0])
    skip = min(config.pipeline.warmup_steps, max(0, steps - 1))
    replicas = [per_rank[d * stages:(d + 1) * stages] for d in range(dp)]  # [replica][stage][step]

    def stage_compute(i: int) -> list[float]:  # each stage's slowest replica at step i
        return [max(replicas[d][k][i]["compute_s"] for d in range(dp)) for k in range(stages)]

    own = [[statistics.median(r["compute_s"] for r in rows[skip:]) for rows in replica] for replica in replicas]
    measured = [max(own[d][k] for d in range(dp)) for k in range(stages)]
    step_s = statistics.median(max(rows[i]["step_s"] for rows in per_rank) for i in range(skip, steps))
    per_step_balance = [balance(stage_compute(i)) for i in range(skip, steps)]
    losses = [sum(replica[-1][i]["loss"] for replica in replicas) / dp for i in range(steps)]
    tokens = statistics.mean(r["tokens"] for r in per_rank[0])
    predicted_balance = plan.compute_balance
    measured_balance = balance(measured)
    report = {
        "task": config.task.name,
        "num_stages": stages,
        "dp_size": dp,
        "world_size": len(per_rank),
        "schedule": config.pipeline.schedule,
        "micro_batches": config.pipeline.micro_batches,
        "steps": steps,
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
        "median_step_s": step_s,  # the name poise train's report gives it
        # as poise train's: the mean over steps of the balance of every rank's compute
        "balance": statistics.mean(balance([rows[i]["compute_s"] for rows in per_rank]) for i in range(skip, steps)),
        # activations and gradients to a stage on another node, DDP traffic of dp groups across nodes
        "comm_inter_node_wire_bytes_per_step": statistics.median(
            sum(rows[i].get("inter_node_bytes", 0) for rows in per_rank) for i in range(skip, steps)),
        "throughput_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "loss_curve": losses,
        "loss_unit": loss_unit,
        "profile": profile.as_dict(),
        "config": config_mod.to_dict(config),
    }
    if dp > 1:
        report.update(replica_report(replicas, own, skip))
    return report


def replica_report(replicas: list[list[list[dict]]], own: list[list[float]], skip: int) -> dict:
    """Each replica's figures (``replicas[d][k]``: replica d's stage k's rows; ``own[d][k]``: its
    median compute seconds) and the DDP reduction's, medians over the steps after ``skip``."""
    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows[skip:])

    per_dp_rank = []
    for d, replica in enumerate(replicas):
        last = replica[-1][-1]
        per_dp_rank.append({
            "dp_rank": d,
            "samples_per_step": replica[0][0]["samples"],
            "targets_per_step": median(replica[0], "targets"),
            "measured_stage_s": own[d],
            "bottleneck_s": max(own[d]),
            "wire_bytes_per_step": [median(rows, "wire_bytes") for rows in replica],
            "dp_comm_s": [median(rows, "dp_comm_s") for rows in replica],
            "dp_exposed_s": [median(rows, "dp_exposed_s") for rows in replica],
            "train_loss_last": last["loss"] / last["weight"] if last["weight"] > 0 else None,
        })
    raw = sum(median(rows, "raw_bytes") for replica in replicas for rows in replica)
    wire = sum(median(rows, "wire_bytes") for replica in replicas for rows in replica)
    return {
        "per_dp_rank": per_dp_rank,
        "dp_balance": balance([r["bottleneck_s"] for r in per_dp_rank]),
        "dp_raw_bytes_per_step": raw,
        "dp_wire_bytes_per_step": wire,
        "dp_compression_ratio": raw / wire if wire else 1.0,
    }


@record
def main(argv: list[str] | None = None) -> int:
    """Worker entry point; errors propagate so torchrun reports them with this rank's traceback."""
    return entry.run_config_job(argv, "poise.pipeline.worker", "pipeline", train_pipeline)


if __name__ == "__main__":
    entry.leave(main())
