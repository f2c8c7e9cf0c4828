"""The runtime's collective pieces on real gloo ranks: comm-hook probe, timeline gather,
config agreement. One spawned world per test, several checks inside it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from poise import config as cfg
from poise.comm.probe import BucketProbe, instrumented
from poise.diagnostics.timeline import FIELDS, StepRecord, Timeline
from poise.runtime.dist import DistContext, check_config_agreement
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _ctx(rank: int, world_size: int) -> DistContext:
    return DistContext(rank, world_size, rank, world_size, "gloo", torch.device("cpu"))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _hooked_grads(rank: int, world_size: int) -> dict:
    """Gradients with the instrumented hook vs plain DDP, plus what the probe saw."""
    torch.manual_seed(100 + rank)  # each rank its own data
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    out = {}
    for name in ("plain", "probed"):
        # small buckets, so the probe has to follow several of them
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.005)
        probe = BucketProbe()
        if name == "probed":
            ddp.register_comm_hook(None, instrumented(default_hooks.allreduce_hook, probe))
        for _ in range(2):  # DDP rebuilds buckets after the first step
            ddp.zero_grad()
            probe.reset()
            nn.functional.mse_loss(ddp(x), y).backward()
        out[name] = [p.grad.clone() for p in ddp.parameters()]
        out[f"{name}_buckets"] = probe.buckets_this_step
        out[f"{name}_ready"] = probe.last_ready
        out[f"{name}_in_flight"] = list(probe.in_flight)
    # the local (un-averaged) gradient, to check the all-reduce really averaged
    local = _model()
    nn.functional.mse_loss(local(x), y).backward()
    out["local"] = [p.grad.clone() for p in local.parameters()]
    return out


def test_probed_hook_matches_plain_ddp_and_counts_every_bucket():
    results = run_ranks(_hooked_grads, world_size=2, timeout_s=90)
    for r in results:
        for a, b in zip(r["plain"], r["probed"], strict=True):
            torch.testing.assert_close(a, b)
        assert r["probed_buckets"] > 1
        assert r["probed_ready"] is not None
        # every bucket's reduction was timed, from its hand-off to its completion
        assert len(r["probed_in_flight"]) == r["probed_buckets"]
        assert all(start <= end for start, end in r["probed_in_flight"])
        assert r["plain_buckets"] == 0  # the probe only sees what it wraps
    mean_local = [(a + b) / 2 for a, b in zip(results[0]["local"], results[1]["local"], strict=True)]
    for got, want in zip(results[0]["probed"], mean_local, strict=True):
        torch.testing.assert_close(got, want)


def _gather_timeline(rank: int, world_size: int, steps: int, every: int):
    tl = Timeline(rank, world_size, every, torch.device("cpu"))
    for step in range(steps):
        tl.record(StepRecord(step=step, start_time_s=1000.0 + step, data_s=0.1, forward_s=rank + 1.0,
                             backward_s=0.5, comm_wait_s=0.0, optim_s=0.01, step_s=2.0, samples=4 + rank,
                             tokens=100 * (rank + 1), padded_tokens=150, loss=3.0, raw_bytes=1234, wire_bytes=617,
                             inter_node_raw_bytes=0, inter_node_wire_bytes=0, codec_s=0.0, comm_busy_s=0.2,
                             comm_hidden_s=0.1, skipped=0))
    tl.flush()
    return tl.table() if rank == 0 else None


def test_timeline_gathers_every_rank_at_intervals_and_on_flush():
    table, other = run_ranks(_gather_timeline, world_size=2, timeout_s=90, steps=7, every=3)
    assert other is None
    assert table.shape == (2, 7, len(FIELDS))
    col = FIELDS.index
    assert table[:, :, col("step")].tolist() == [list(range(7))] * 2
    assert table[1, :, col("forward_s")].tolist() == [2.0] * 7
    assert table[0, :, col("samples")].tolist() == [4] * 7
    assert table[1, :, col("tokens")].tolist() == [200] * 7


def _agreement(rank: int, world_size: int, differ: bool):
    config = cfg.RunConfig()
    if differ and rank == 1:
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, lr=0.5))
    try:
        check_config_agreement(config, _ctx(rank, world_size))
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_config_disagreement_stops_every_rank():
    assert run_ranks(_agreement, world_size=2, timeout_s=60, differ=False) == ["ok", "ok"]
    messages = run_ranks(_agreement, world_size=2, timeout_s=60, differ=True)
    for m in messages:
        assert "ranks [1] were started with a different config than rank 0" in m
