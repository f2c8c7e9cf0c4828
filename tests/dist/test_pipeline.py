"""A 2-stage pipeline on real gloo ranks computes what the unsplit model computes.

One spawned world runs both schedules (GPipe and 1F1B) on the same code-lm batch: the
pipeline's loss equals the unsplit model's loss, every stage's gradients equal the unsplit
model's gradients for the same parameters, and one clipped SGD step leaves the same weights
(SGD, not Adam, so that a wrong clipping factor would show in the weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _model():
    from poise.tasks.code_lm import ByteTransformer

    torch.manual_seed(0)
    return ByteTransformer(max_seq_len=48, d_model=32, num_layers=3, num_heads=4)


def _batch():
    from poise.tasks.code_lm import collate_bytes

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, 48, (6,), generator=g)  # unequal lengths: micro-batches hold unequal tokens
    return collate_bytes([torch.randint(0, 256, (int(n),), generator=g, dtype=torch.uint8) for n in lengths])


def _stage_vs_unsplit(rank: int, world_size: int) -> dict:
    from poise.pipeline.stage import StageRunner, stage_layers
    from poise.tasks.code_lm import code_lm_loss

    batch = _batch()
    out = {}
    for schedule in ("gpipe", "1f1b"):
        reference = _model()
        names = {id(p): n for n, p in reference.named_parameters()}
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_loss = code_lm_loss(reference, batch)
        ref_loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        ref_opt.step()

        model = _model()
        ids = {id(p): n for n, p in model.named_parameters()}
        layers = model.pipeline_layers()  # embedding, 3 blocks, head
        module = stage_layers(layers, [0, 3, 5], rank)
        runner = StageRunner(module, stage_index=rank, num_stages=world_size, schedule=schedule,
                             num_micro_batches=3, optimizer=None)
        step = runner.step(batch.inputs if rank == 0 else None, batch.targets if rank == world_size - 1 else None)
        grad_gap = max(float((p.grad - ref_grads[ids[id(p)]]).abs().max()) for p in module.parameters())
        # the same step again with the optimizer and global-norm clipping across both stages
        model2 = _model()
        module2 = stage_layers(model2.pipeline_layers(), [0, 3, 5], rank)
        ids2 = {id(p): n for n, p in model2.named_parameters()}
        optimizer = torch.optim.SGD(module2.parameters(), lr=0.1)
        runner2 = StageRunner(module2, stage_index=rank, num_stages=world_size, schedule=schedule,
                              num_micro_batches=3, optimizer=optimizer, grad_clip_norm=0.5)
        runner2.step(batch.inputs if rank == 0 else None, batch.targets if rank == world_size - 1 else None)
        ref_params = {names[id(p)]: p for p in reference.parameters()}
        weight_gap = max(float((p - ref_params[ids2[id(p)]]).abs().max()) for p in module2.parameters())
        out[schedule] = {"loss": step.loss, "ref_loss": float(ref_loss), "grad_gap": grad_gap,
                         "weight_gap": weight_gap, "compute_s": step.compute_s, "ref_norm": ref_norm,
                         "num_params": sum(1 for _ in module.parameters())}
    return out


def test_two_stage_pipeline_matches_the_unsplit_model():
    first, last = run_ranks(_stage_vs_unsplit, world_size=2, timeout_s=100)
    for schedule in ("gpipe", "1f1b"):
        a, b = first[schedule], last[schedule]
        assert b["ref_norm"] > 0.5  # the clipping was active
        assert a["loss"] is None  # only the last stage sees the loss
        assert b["loss"] == pytest.approx(b["ref_loss"], rel=1e-5, abs=1e-6)
        for r in (a, b):
            assert r["grad_gap"] < 1e-5
            assert r["weight_gap"] < 1e-5
            assert r["compute_s"] > 0
        assert a["num_params"] > 0 and b["num_params"] > 0
