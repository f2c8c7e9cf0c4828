"""Compression hooks and reducers on real gloo ranks.

Spawning a world costs seconds, so each test runs one world and loops over codecs inside it.
Checks: every codec through DDP (several buckets) leaves every rank with the same
parameters; ``none`` is bit-identical to plain DDP; torch's PowerSGD hook runs with one
bucket; each reducer path computes sum_r w_r g_r; a NaN on one rank reaches every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import poise.comm
from poise.comm import codecs, registry
from poise.comm.builder import build, check_backend, requires_single_bucket
from poise.comm.codecs import ErrorFeedback
from poise.comm.reducers import make_reducer
from poise.comm.state import StepStats
from poise.comm.trial import earliest_start
from poise.config import CommConfig
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

STEPS = 4
WEIGHTS = (0.5, 0.3, 0.2)  # rank r's share in the weighted-sum checks (3 ranks)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]


def _train(rank: int, config: CommConfig | str | None,
           bucket_cap_mb: float) -> tuple[list[torch.Tensor], list[StepStats]]:
    """Parameters after STEPS SGD steps with ``config``'s hook: a CommConfig through build(),
    a codec name through the user-facing poise.comm.hook(), or plain DDP for None."""
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=bucket_cap_mb)
    state = None
    if isinstance(config, CommConfig):
        check_backend(config, "gloo")
        hook, state = build(config)
        ddp.register_comm_hook(state, hook)
    elif isinstance(config, str):
        compress = poise.comm.hook(config, ratio=0.1)
        ddp.register_comm_hook(None, compress)
        state = compress.state
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    stats = []
    for x, y in _batches(rank):
        if state is not None:
            state.reset_step()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if state is not None:
            stats.append(state.step_stats())
    return [p.detach().clone() for p in ddp.parameters()], stats


def _every_codec(rank: int, world_size: int) -> dict:
    out: dict = {"plain": _train(rank, None, 0.005)[0]}
    for name in registry.CODECS:
        single = requires_single_bucket(CommConfig(codec=name))
        out[name] = _train(rank, CommConfig(codec=name, topk_ratio=0.1), 1000.0 if single else 0.005)
    out["hook-api"] = _train(rank, "topk", 0.005)
    return out


def test_every_codec_through_ddp_keeps_ranks_identical_and_none_matches_plain_ddp():
    results = run_ranks(_every_codec, world_size=2, timeout_s=120)
    first = results[0]
    for r in results[1:]:
        for name in registry.CODECS:
            for a, b in zip(first[name][0], r[name][0], strict=True):
                assert torch.equal(a, b), name
    # "none" is the same arithmetic as plain DDP, so bit for bit the same parameters; so is
    # "auto" before its start step: its dry runs after each step leave the model untouched
    assert STEPS <= earliest_start(CommConfig().auto_trial_steps)
    for name in ("none", "auto"):
        for a, b in zip(first["plain"], first[name][0], strict=True):
            assert torch.equal(a, b), name
    # the user-facing hook() is the same as build() with the same settings
    for a, b in zip(first["topk"][0], first["hook-api"][0], strict=True):
        assert torch.equal(a, b)
    initial = list(_model().parameters())
    for name in registry.CODECS:
        params, stats = first[name]
        assert any(not torch.equal(p, q) for p, q in zip(params, initial, strict=True)), name
        assert len(stats) == STEPS
        last = stats[-1]
        if name == "torch-powersgd":
            assert last.buckets == 1
        else:
            assert last.buckets > 1, name  # several buckets: the hard case for torch's PowerSGD
        assert last.raw_bytes == sum(p.numel() * 4 for p in initial), name
        if name not in ("none", "auto"):
            assert last.wire_bytes < last.raw_bytes, name  # compressed after the warm-up steps
            if name != "torch-fp16":  # torch's fp16 hook compresses from the first step
                assert stats[0].wire_bytes == stats[0].raw_bytes, name  # step 0 runs uncompressed


def _tensor(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank))


def _low_rank_tensor(rank: int) -> torch.Tensor:
    """A 64 x 64 matrix of rank 2 whose column space is shared by all ranks (flat)."""
    a = torch.randn(64, 2, generator=torch.Generator().manual_seed(3))
    b = torch.randn(2, 64, generator=torch.Generator().manual_seed(11 + rank))
    return (a @ b).view(-1)


WEIGHTED_CASES = {  # name -> (options, tensor size)
    "none": ({}, 1000),
    "fp16": ({}, 1000),
    "bf16": ({}, 1000),
    "randomk": ({"ratio": 0.1}, 1000),
    "topk": ({"ratio": 1.0}, 1000),
    "sign": ({}, 1001),
    "int8": ({"chunk_size": 100}, 1000),
    "powersgd": ({"rank": 4}, 4096),
}


def _weighted(rank: int, world_size: int) -> dict:
    out = {}
    for name, (options, n) in WEIGHTED_CASES.items():
        reducer = make_reducer(codecs.make(name, **options))
        x = _low_rank_tensor(rank) if name == "powersgd" else _tensor(rank, n)
        out[name] = reducer.reduce(x, key=0, weight=WEIGHTS[rank]).wait()
    mean = make_reducer(codecs.make("none")).reduce(_tensor(rank, 10), key=1).wait()
    return {"weighted": out, "mean": mean}


def _expected(name: str, n: int) -> torch.Tensor:
    options = WEIGHTED_CASES[name][0]
    total = torch.zeros(n)
    for rank, w in enumerate(WEIGHTS):
        x = w * (_low_rank_tensor(rank) if name == "powersgd" else _tensor(rank, n))
        if name == "sign":  # what the sign codec sends: the mean magnitude with the sign
            x = torch.where(x < 0, -1.0, 1.0) * x.abs().mean()
        elif name == "randomk":  # only the shared random indices travel
            indices = codecs.make(name, **options).encode(x, key=0).context
            kept = torch.zeros(n)
            kept[indices] = x[indices]
            x = kept
        total += x
    return total


def test_each_reducer_path_returns_the_weighted_sum():
    results = run_ranks(_weighted, world_size=3, timeout_s=90)
    tolerance = {"fp16": 2e-3, "bf16": 2e-2, "int8": 2e-2, "topk": 2e-3, "powersgd": 1e-4}
    for name, (_, n) in WEIGHTED_CASES.items():
        want = _expected(name, n)
        for r in results:
            got = r["weighted"][name]
            assert torch.equal(got, results[0]["weighted"][name]), name  # identical on every rank
            atol = tolerance.get(name, 1e-6)
            torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=name)
    mean = sum(_tensor(rank, 10) for rank in range(3)) / 3
    torch.testing.assert_close(results[0]["mean"], mean)


def _nan_on_one_rank(rank: int, world_size: int) -> dict:
    out = {}
    for name, options in (("fp16", {}), ("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2})):
        ef = ErrorFeedback(codecs.make(name, **options), on_nonfinite="skip")
        reducer = make_reducer(ef)
        n = 4096
        reducer.reduce(_tensor(rank, n), key=0).wait()
        before = ef.residual(0).clone()
        bad = _tensor(rank, n)
        if rank == 1:
            bad[5] = float("nan")
        result = reducer.reduce(bad, key=0).wait()
        out[name] = {"all_nan_somewhere": not torch.isfinite(result).all().item(),
                     "residual_kept": torch.equal(ef.residual(0), before), "skipped": ef.num_skipped}
    return out


def test_nan_on_one_rank_is_seen_by_every_rank_in_skip_mode():
    results = run_ranks(_nan_on_one_rank, world_size=2, timeout_s=90)
    for rank, r in enumerate(results):
        for name, seen in r.items():
            assert seen["all_nan_somewhere"], (rank, name)
            assert seen["skipped"] == (1 if rank == 1 else 0), (rank, name)
            if rank == 1:
                assert seen["residual_kept"], name


def _local_first(rank: int, world_size: int) -> dict:
    """One compressed step (several buckets), local first: each rank's gradient is its own whole
    gradient plus the other ranks' sent parts (all over world_size), whatever the codec."""
    out = {}
    for name, options in (("topk", {"ratio": 0.05}), ("randomk", {"ratio": 0.05}), ("powersgd", {"rank": 2})):
        model = _model()
        x, y = _batches(rank)[0]
        nn.functional.mse_loss(model(x), y).backward()  # this rank's own gradient, no DDP
        own = {n: p.grad.clone() for n, p in model.named_parameters()}
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.005)
        compress = poise.comm.hook(name, start_step=0, local_first=True, **options)
        ddp.register_comm_hook(None, compress)
        nn.functional.mse_loss(ddp(x), y).backward()
        got = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        # the same step without local_first: the mean of everyone's sent parts
        ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.005)
        ddp.register_comm_hook(None, poise.comm.hook(name, start_step=0, **options))
        nn.functional.mse_loss(ddp(x), y).backward()
        mean_sent = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        out[name] = {"own": own, "got": got, "mean_sent": mean_sent,
                     "residuals": {k: v.clone() for k, v in compress.state.codec._residuals.items()}}
    return out


def test_local_first_keeps_each_ranks_own_unsent_gradient():
    results = run_ranks(_local_first, world_size=2, timeout_s=90)
    for name in ("topk", "randomk", "powersgd"):
        a, b = results[0][name], results[1][name]
        for r in (a, b):  # something was held back, so the identity below means something
            assert sum(float(t.abs().sum()) for t in r["residuals"].values()) > 0, name
        # rank r applies mean_sent + (g_r - s_r)/W: the two ranks now differ ...
        assert any(not torch.equal(a["got"][n], b["got"][n]) for n in a["got"]), name
        # ... and summed over the ranks, the sent parts count once and the own gradients once:
        # got_0 + got_1 = 2 mean_sent + (g_0 + g_1)/2 - (s_0 + s_1)/2 = mean_sent + mean_g
        for n in a["got"]:
            want = a["mean_sent"][n] + (a["own"][n] + b["own"][n]) / 2
            torch.testing.assert_close(a["got"][n] + b["got"][n], want, rtol=1e-4, atol=1e-6, msg=(name, n))
