"""Evaluation of a model sharded with FSDP2 on real gloo ranks: every rank runs as many forwards
(each gathers the blocks' parameters from all ranks), even when the held-out samples do not
split evenly, and the figures are those of the whole model on one process."""

from __future__ import annotations

import pytest
import torch

from poise.config import CommConfig, ParallelConfig
from poise.runtime.dist import DistContext
from poise.tasks.digits import build_digits_task
from poise.train.evaluate import evaluate
from poise.train.shard import shard_model
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _evaluate(rank: int, world_size: int, max_samples: int, batch_size: int) -> tuple[float, float, int]:
    task = build_digits_task(seed=0)
    torch.manual_seed(0)
    model = task.build_model()
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size,
                      backend="gloo", device=torch.device("cpu"))
    if world_size > 1:
        model = shard_model(model, ParallelConfig(mode="fsdp"), CommConfig(), world_size=world_size,
                            nproc=world_size, device=ctx.device)
    result = evaluate(model, task, ctx, max_samples=max_samples, batch_size=batch_size)
    return result.loss, result.accuracy, result.count


def test_uneven_held_out_shares_evaluate_in_lockstep_and_match_one_process():
    # 65 samples over 2 ranks in batches of 16: rank 0 has 33 (3 batches), rank 1 32 (2)
    (one,) = run_ranks(_evaluate, 1, timeout_s=60, max_samples=65, batch_size=16)
    two = run_ranks(_evaluate, 2, timeout_s=60, max_samples=65, batch_size=16)
    assert one[2] == two[0][2] == two[1][2] == 65
    for got in two:
        assert got[0] == pytest.approx(one[0], rel=1e-5) and got[1] == one[1]
