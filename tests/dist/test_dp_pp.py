"""Data x pipeline parallelism on 4 real gloo ranks (2 stages x 2 replicas) trains what one
process trains on the same samples.

Each step's batch of 10 samples of unequal lengths is split 6 / 4 between the replicas (in units
of the 2 micro-batches: unequal samples and unequal real tokens), so the exact loss weights
matter; two steps of SGD with global-norm clipping (active: the reference norm is above the
cap) leave every stage's weights equal to the single process's, which they would not if the
weights, the clipping group or the reduction over the replicas were wrong. A second world
runs fp16 on the ``dp`` all-reduce: half the bytes, gradients within fp16's rounding of the
exact ones, and not equal to them.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.dist

LENGTH = 47  # max_seq_len - 1: the pipeline's fixed shape
BOUNDARIES = [0, 3, 5]  # embedding+block0+block1 | block2+head


def _model():
    from poise.tasks.code_lm import ByteTransformer

    torch.manual_seed(0)
    return ByteTransformer(max_seq_len=48, d_model=32, num_layers=3, num_heads=4)


def _batch(step: int):
    from poise.pipeline.batches import pad_batch
    from poise.tasks.code_lm import collate_bytes

    g = torch.Generator().manual_seed(10 + step)
    lengths = torch.randint(4, 48, (10,), generator=g)
    samples = [torch.randint(0, 256, (int(n),), generator=g, dtype=torch.uint8) for n in lengths]
    return pad_batch(collate_bytes(samples), LENGTH)


def _reference(steps: int, clip: float) -> dict:
    """One process, the whole batches: losses, the gradients of step 0, the weights after ``steps``."""
    from poise.tasks.code_lm import code_lm_loss

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms, grads = [], [], {}
    for step in range(steps):
        loss = code_lm_loss(model, _batch(step))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "grads": grads, "model": model,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _held_out():
    """7 held-out samples: fewer than a batch of 10, so the evaluation fills rows that count nothing."""
    from poise.tasks.code_lm import collate_bytes

    g = torch.Generator().manual_seed(99)
    samples = [torch.randint(0, 256, (int(n),), generator=g, dtype=torch.uint8)
               for n in torch.randint(4, 48, (7,), generator=g)]
    return types.SimpleNamespace(eval_set=samples, collate=collate_bytes)


def _stage(grid, schedule: str, codec: str, optimizer: bool, clip: float):
    """This rank's stage in DDP over its replicas, its runner, and the model's parameter names."""
    from poise.config import CommConfig
    from poise.pipeline.replicas import ReplicaSync, replica_shares
    from poise.pipeline.stage import StageRunner, stage_examples, stage_layers

    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    layers = model.pipeline_layers()
    module = stage_layers(layers, BOUNDARIES, grid.pp_rank)
    share = replica_shares(10, LENGTH, grid.dp_size, 2)[grid.dp_rank]
    example = stage_examples(layers, BOUNDARIES, grid.pp_rank, _batch(0).inputs[share][: len(share) // 2])
    sync = ReplicaSync(module, CommConfig(codec=codec, error_feedback=False, start_step=0), group=grid.dp_group,
                       backend="gloo", compression_start=0, device=torch.device("cpu"))
    opt = torch.optim.SGD(module.parameters(), lr=0.1) if optimizer else None
    runner = StageRunner(sync.model, stage_index=grid.pp_rank, num_stages=grid.pp_size, schedule=schedule,
                         num_micro_batches=2, optimizer=opt, grad_clip_norm=clip, group=grid.pp_group,
                         example=example)
    return module, names, sync, runner


def _step(grid, runner, sync, step: int):
    from poise.pipeline.replicas import replica_shares, replica_weight

    batch = _batch(step)
    shares = replica_shares(batch.inputs.shape[0], LENGTH, grid.dp_size, 2)
    share = torch.from_numpy(shares[grid.dp_rank])
    weight = replica_weight(batch.targets, shares, grid.dp_rank)
    sync.begin_step()
    rec = runner.step(batch.inputs[share] if runner.is_first else None,
                      batch.targets[share] if runner.is_last else None, weight)
    return rec, sync.end_step(), len(share)


def _gap(module, names, reference: dict) -> float:
    return max(float((p.detach() - reference[names[id(p)]]).abs().max()) for p in module.parameters())


def _dp_pp_vs_one_process(rank: int, world_size: int) -> dict:
    from poise.pipeline.replicas import make_grid

    grid = make_grid(2)
    reference = _reference(steps=2, clip=0.5)
    out = {"dp_rank": grid.dp_rank, "pp_rank": grid.pp_rank, "ref_losses": reference["losses"],
           "ref_norms": reference["norms"]}
    for schedule in ("gpipe", "1f1b"):
        module, names, sync, runner = _stage(grid, schedule, "none", optimizer=True, clip=0.5)
        losses, shares = [], []
        for step in range(2):
            rec, traffic, rows = _step(grid, runner, sync, step)
            losses.append(rec.loss)
            shares.append(rows)
        out[schedule] = {"losses": losses, "shares": shares, "weight_gap": _gap(module, names, reference["params"]),
                         "wire_bytes": traffic.wire_bytes, "raw_bytes": traffic.raw_bytes}
    # the trained pipeline evaluated on held-out samples, as the reference model on them
    from poise.pipeline.evaluate import evaluate
    from poise.pipeline.replicas import replica_shares
    from poise.tasks.base import IGNORE_INDEX
    from poise.tasks.code_lm import code_lm_loss

    task = _held_out()
    loss_sum, count = evaluate(runner, task, np.arange(7), batch_size=10, length=LENGTH,
                               shares=replica_shares(10, LENGTH, 2, 2), dp_rank=grid.dp_rank)
    with torch.no_grad():
        batch = task.collate(task.eval_set)
        out["eval"] = {"mean": loss_sum / count, "count": count,
                       "ref_mean": float(code_lm_loss(reference["model"], batch)),
                       "ref_count": int((batch.targets != IGNORE_INDEX).sum())}
    return out


def test_dp_x_pp_equals_one_process_on_the_same_samples():
    results = run_ranks(_dp_pp_vs_one_process, world_size=4, timeout_s=240)
    assert [(r["dp_rank"], r["pp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref_losses, ref_norms = results[0]["ref_losses"], results[0]["ref_norms"]
    assert min(ref_norms) > 0.5  # the clipping was active at both steps
    for schedule in ("gpipe", "1f1b"):
        per_rank = [r[schedule] for r in results]
        assert [r["shares"] for r in per_rank] == [[6, 6], [6, 6], [4, 4], [4, 4]]  # unequal shares
        last = [per_rank[1], per_rank[3]]  # each replica's last stage
        assert per_rank[0]["losses"] == [None, None] and per_rank[2]["losses"] == [None, None]
        for step in range(2):
            # the mean of the replicas' weighted losses is the whole batch's mean loss
            loss = sum(r["losses"][step] for r in last) / 2
            assert loss == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6)
            assert last[0]["losses"][step] != pytest.approx(last[1]["losses"][step], rel=1e-3)  # unequal shares
        for r in per_rank:
            assert r["weight_gap"] < 1e-5, (schedule, r)
            assert r["raw_bytes"] > 0 and r["wire_bytes"] == r["raw_bytes"]  # fp32 all-reduce on dp
    for r in results:  # every rank has the held-out loss of the trained weights
        assert r["eval"]["count"] == r["eval"]["ref_count"]
        assert r["eval"]["mean"] == pytest.approx(r["eval"]["ref_mean"], rel=1e-5)


def _fp16_on_dp(rank: int, world_size: int) -> dict:
    from poise.pipeline.replicas import make_grid

    grid = make_grid(2)
    reference = _reference(steps=1, clip=0.0)
    module, names, sync, runner = _stage(grid, "1f1b", "fp16", optimizer=False, clip=0.0)
    rec, traffic, _ = _step(grid, runner, sync, 0)
    gaps, scales = [], []
    for p in module.parameters():
        exact = reference["grads"][names[id(p)]]
        gaps.append(float((p.grad - exact).abs().max()))
        scales.append(float(exact.abs().max()))
    return {"loss": rec.loss, "ref_loss": reference["losses"][0], "gaps": gaps, "scales": scales,
            "wire_bytes": traffic.wire_bytes, "raw_bytes": traffic.raw_bytes,
            "numel": sum(p.numel() for p in module.parameters())}


def test_fp16_on_the_dp_all_reduce_halves_the_bytes_within_its_rounding():
    results = run_ranks(_fp16_on_dp, world_size=4, timeout_s=180)
    assert (results[1]["loss"] + results[3]["loss"]) / 2 == pytest.approx(results[1]["ref_loss"], rel=1e-5)
    for r in results:
        assert r["raw_bytes"] == 4 * r["numel"] and r["wire_bytes"] == 2 * r["numel"]
        # each replica's weighted gradient and their sum are rounded to fp16 (2^-11 relative) once each
        for gap, scale in zip(r["gaps"], r["scales"], strict=True):
            assert gap <= 2**-8 * scale + 1e-7, (gap, scale)
        assert max(r["gaps"]) > 0  # fp16 was on the wire: not the exact fp32 sum
