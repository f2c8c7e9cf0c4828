"""Reducer wrappers and the state protocol on real gloo ranks (one world of 2 nodes x 2 ranks).

Nodes are emulated as in test_collectives.py (node = rank % 2). Checks what the hook-level
tests do not: local-first over ring and tree and on a second call (a residual already
there), hierarchical reduction with weights, which collectives count as hierarchical, the
wrappers' refusals, and that poise's and torch's states both meet ``CommState``
(bypass, zero inter-node counters, torch's refusal of a weight).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import poise.comm
from poise.comm import codecs, collectives
from poise.comm.builder import build
from poise.comm.collectives import Hierarchical, Topology
from poise.comm.reducers import make_reducer
from poise.comm.state import CommState, Counters, StepStats
from poise.comm.wrappers import HierarchicalReducer, LocalFirst, compose
from poise.config import CommConfig
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

WEIGHTS = (0.1, 0.2, 0.3, 0.4)
N = 2000


def _x(rank: int, call: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(10 * rank + call))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 2))


def _backward(ddp: nn.Module, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    nn.functional.mse_loss(ddp(torch.randn(8, 16, generator=g)), torch.randn(8, 2, generator=g)).backward()


def _local_first(topology: Topology) -> dict:
    """Per collective, two calls: local-first's result minus the plain reducer's (same codec
    state, same inputs), and this rank's residual change over the call."""
    out = {}
    for name in ("flat", "ring", "tree"):
        collective = collectives.make(name, topology=topology)
        plain_ef = codecs.ErrorFeedback(codecs.make("topk", ratio=0.05))
        plain = make_reducer(plain_ef, collective=collective)
        lf_ef = codecs.ErrorFeedback(codecs.make("topk", ratio=0.05))
        local_first = LocalFirst(make_reducer(lf_ef, collective=collective))
        calls = []
        for call in range(2):
            before = lf_ef.residual(0).clone() if lf_ef.residual(0) is not None else torch.zeros(N)
            want = plain.reduce(_x(topology.rank, call), key=0).wait()
            got = local_first.reduce(_x(topology.rank, call), key=0).wait()
            calls.append({"extra": got - want, "residual_change": lf_ef.residual(0) - before})
        out[name] = calls
    return out


def _weighted_hierarchical(topology: Topology, rank: int) -> dict:
    """Weighted sums through a hierarchical reduction and through a flat one (random-k: the
    same shared indices everywhere, so both are exact)."""
    hierarchical = Hierarchical(topology)
    inter = make_reducer(codecs.make("randomk", ratio=0.2), topology.leader_group) if topology.is_leader else None
    counters = Counters()
    hier = HierarchicalReducer(hierarchical, inter, counters=counters).reduce(_x(rank, 0), key=0,
                                                                             weight=WEIGHTS[rank]).wait()
    flat = make_reducer(codecs.make("randomk", ratio=0.2)).reduce(_x(rank, 0), key=0, weight=WEIGHTS[rank]).wait()
    return {"hier": hier, "flat": flat, "stats": counters.snapshot()}


def _refusals(topology: Topology) -> dict:
    hierarchical = collectives.make("hierarchical", topology=topology)
    errors = {}
    for label, codec, collective in (("no error feedback", codecs.make("topk", ratio=0.1), None),
                                     ("hierarchical", codecs.ErrorFeedback(codecs.make("topk", ratio=0.1)),
                                      hierarchical)):
        try:
            compose(codec, None, collective, Counters(), Counters(), local_first=True)
        except ValueError as e:
            errors[label] = str(e)
    return errors


def _states(rank: int) -> dict:
    """poise's state bypassed for one backward, then torch's fp16 state with a weight set."""
    out: dict = {}
    plain = DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    _backward(plain, rank)
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    compress = poise.comm.hook("topk", ratio=0.1, start_step=0)
    ddp.register_comm_hook(None, compress)
    state = compress.state
    with state.bypassed():
        _backward(ddp, rank)
    out["poise"] = {"protocol": isinstance(state, CommState), "step": state.step,
                    "residuals": len(state.codec.state_dict()["residuals"]), "stats": state.step_stats(),
                    "same_as_ddp": all(torch.equal(p.grad, q.grad) for p, q in zip(ddp.parameters(),
                                                                                plain.parameters(), strict=True))}
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    hook, torch_state = build(CommConfig(codec="torch-fp16"))
    ddp.register_comm_hook(torch_state, hook)
    _backward(ddp, rank)
    out["torch"] = {"protocol": isinstance(torch_state, CommState), "inter_node": torch_state.inter_node_stats(),
                    "buckets": torch_state.step_stats().buckets}
    torch_state.weight = WEIGHTS[rank]  # every rank: each refuses before any collective
    try:
        _backward(ddp, rank)
        out["torch"]["weight_error"] = None
    except Exception as e:  # DDP re-raises the hook's ValueError from backward
        out["torch"]["weight_error"] = str(e)
    return out


def _world(rank: int, world_size: int) -> dict:
    os.environ.update(GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    topology = Topology.discover()
    out = {
        "as_hierarchical": {name: type(collectives.make(name, topology=topology).as_hierarchical()).__name__
                            for name in collectives.COLLECTIVES},
        "local_first": _local_first(topology),
        "weighted": _weighted_hierarchical(topology, rank),
        "refusals": _refusals(topology),
        "states": _states(rank),
    }
    dist.barrier()
    topology.close()
    return out


def test_wrappers_compose_and_both_states_meet_the_protocol():
    results = run_ranks(_world, world_size=4, timeout_s=120)
    for r in results:
        # auto on 2 nodes x 2 ranks reduces hierarchically; the others do not
        assert r["as_hierarchical"] == {"flat": "NoneType", "ring": "NoneType", "tree": "NoneType",
                                        "hierarchical": "Hierarchical", "auto": "Hierarchical"}
    for rank, r in enumerate(results):
        for name, calls in r["local_first"].items():
            for call, c in enumerate(calls):
                # local first adds exactly this rank's residual change to the plain result
                assert float(c["residual_change"].abs().sum()) > 0, (name, call)
                torch.testing.assert_close(c["extra"], c["residual_change"], atol=1e-6, rtol=0,
                                           msg=f"{name} call {call} rank {rank}")
        weighted = r["weighted"]
        torch.testing.assert_close(weighted["hier"], weighted["flat"], atol=1e-6, rtol=0)
        assert torch.equal(weighted["hier"], results[0]["weighted"]["hier"])
        assert weighted["stats"] == StepStats(raw_bytes=N * 4, wire_bytes=N * 4, buckets=1)
        assert all("local_first needs a codec with error feedback" in e for e in r["refusals"].values())
        assert set(r["refusals"]) == {"no error feedback", "hierarchical"}
        poise_state, torch_state = r["states"]["poise"], r["states"]["torch"]
        assert poise_state["protocol"] and torch_state["protocol"]
        # bypassed: plain DDP's gradient, no step, no residual, the bytes counted uncompressed
        assert poise_state["same_as_ddp"] and poise_state["step"] == 0 and poise_state["residuals"] == 0
        assert poise_state["stats"].wire_bytes == poise_state["stats"].raw_bytes > 0
        assert torch_state["inter_node"] == StepStats() and torch_state["buckets"] > 0
        assert "torch's comm hooks only average" in torch_state["weight_error"]
