"""PowerSGD on its communication thread (``wrappers.OnCommThread``), on real gloo ranks.

Checks that the caller never waits (rank 0 hands over three buckets before rank 1 has called
at all: a reduction waiting on the caller's thread would deadlock here), that several buckets
in flight stay matched across ranks, and that error feedback's in-place residual keeps
PowerSGD's invariant: the reduced gradient is the sum over ranks of ``corrected - residual``
(nothing lost, only delayed), on the first call and on a second with residuals and warm
starts in place.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import poise.comm
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

# three buckets, each the concatenation of a few parameters (matrices and a bias)
SHAPES = {0: [(20, 30), (30,), (16, 40)], 1: [(64, 8), (8,)], 2: [(12, 50), (50, 12), (7,)]}


def _x(rank: int, key: int, call: int) -> torch.Tensor:
    numel = sum(math.prod(s) for s in SHAPES[key])
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + 10 * key + call))


def _ranks(rank: int, world_size: int) -> dict:
    state = poise.comm.make_state("powersgd", rank=2, start_step=0)
    ef = state.codec
    store = dist.distributed_c10d._get_default_store()
    out: dict = {"reducer": repr(state.reducer), "calls": []}
    for call in range(2):
        before = {k: (ef.residual(k).clone() if ef.residual(k) is not None else torch.zeros_like(_x(0, k, 0)))
                  for k in SHAPES}
        if rank == 1:
            store.wait([f"go-{call}"])  # rank 0 has all its futures already
        futures = {k: state.reducer.reduce(_x(rank, k, call), key=k, shapes=SHAPES[k]) for k in SHAPES}
        if rank == 0:
            out["calls"].append({"pending_before_peer": [not f.done() for f in futures.values()]})
            store.set(f"go-{call}", "1")
        results = {k: f.wait().clone() for k, f in futures.items()}
        sent = {k: _x(rank, k, call) / world_size + before[k] - ef.residual(k) for k in SHAPES}
        if rank == 1:
            out["calls"].append({})
        out["calls"][call].update(results=results, sent=sent)
    dist.barrier()
    return out


def test_powersgd_reduces_on_its_thread_and_keeps_the_error_feedback_invariant():
    results = run_ranks(_ranks, world_size=2, timeout_s=90)
    assert results[0]["reducer"].startswith("OnCommThread(LowRankReducer(")
    for call in range(2):
        # the caller got every future back before its peer had started: nothing waited
        assert results[0]["calls"][call]["pending_before_peer"] == [True, True, True]
        for key in SHAPES:
            got = [r["calls"][call]["results"][key] for r in results]
            torch.testing.assert_close(got[0], got[1], atol=0, rtol=0)
            want = sum(r["calls"][call]["sent"][key] for r in results)
            torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5, msg=f"call {call} bucket {key}")


def _dropped_trial(rank: int, world_size: int) -> dict:
    """A trial that drops PowerSGD: the next uncompressed step carries what error feedback held
    back, so the gradient is the plain mean plus the mean residual (nothing lost)."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from poise.comm.adapter import compressed_hook
    from poise.comm.trial import CodecTrial

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1000)  # one bucket
    trial = CodecTrial(3, steps=2)
    state = poise.comm.make_state("powersgd", rank=2, start_step=3, trial=trial)
    ddp.register_comm_hook(state, compressed_hook)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(10 * step + rank)
        return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)

    for step in range(4):  # 0-2 uncompressed, 3 compressed: a residual is left
        ddp.zero_grad()
        x, y = batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
    residual = state.codec.residual(0).clone()
    trial.decide(1.0, 1.0)  # not faster: dropped
    ddp.zero_grad()
    x, y = batch(4)
    nn.functional.mse_loss(ddp(x), y).backward()
    local = copy.deepcopy(ddp.module)
    local.zero_grad()
    nn.functional.mse_loss(local(x), y).backward()
    expected = torch.stack([sum(p.grad.sum() for p in local.parameters()), residual.sum() * world_size])
    dist.all_reduce(expected)
    return {"got": float(sum(p.grad.sum() for p in ddp.parameters())), "want": float(expected.sum() / world_size),
            "residual_sum": float(residual.abs().sum()), "left": state.codec.residual(0)}


def test_a_dropped_trial_sends_what_error_feedback_held_back():
    results = run_ranks(_dropped_trial, world_size=2, timeout_s=90)
    for r in results:
        assert r["residual_sum"] > 0 and r["left"] is None
        assert r["got"] == pytest.approx(r["want"], rel=1e-4, abs=1e-5)
