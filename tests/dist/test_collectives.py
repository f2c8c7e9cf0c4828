"""Collective algorithms on real gloo ranks: each equals the backend's all-reduce and all-gather.

One world per world size (spawning costs seconds); each loops over algorithms and sizes.
Nodes are emulated by setting torchrun's ``GROUP_RANK``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
in each rank before the topology is discovered: 2 ranks as 2 nodes × 1, 3 ranks as nodes of
2 + 1, 4 ranks as 2 nodes × 2 whose ranks interleave (node = rank % 2), so node order and
global order differ.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from poise.comm import codecs, collectives, registry
from poise.comm.builder import build
from poise.comm.collectives import Hierarchical, NodeLayout, Topology
from poise.comm.reducers import make_reducer
from poise.comm.wrappers import HierarchicalReducer
from poise.config import CommConfig
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

ALGORITHMS = ("flat", "ring", "tree", "hierarchical", "auto")
SEGMENT_BYTES = 1024  # small segments, so ring blocks and hierarchical tensors go in several pipelined pieces


def _node(rank: int, world_size: int) -> tuple[int, int]:
    """(node id, local rank) of the emulated layouts in the module docstring."""
    if world_size == 4:
        return rank % 2, rank // 2
    if world_size == 3:
        return (0, rank) if rank < 2 else (1, 0)
    return rank, 0


def _emulate_nodes(rank: int, world_size: int) -> Topology:
    node, local = _node(rank, world_size)
    local_world = sum(1 for r in range(world_size) if _node(r, world_size)[0] == node)
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(local_world))
    return Topology.discover()


def _sizes(world_size: int) -> list[int]:
    return [0, 1, world_size - 1, world_size + 1, 1001, 5000]


def _input(rank: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * n + rank)).to(dtype)


def _every_algorithm(rank: int, world_size: int, topology: Topology | None = None) -> dict:
    topology = topology or _emulate_nodes(rank, world_size)
    algos = {name: collectives.make(name, topology=topology, segment_bytes=SEGMENT_BYTES, small_bytes=256)
             for name in ALGORITHMS}
    out: dict = {"reduce": {}, "gather": {}}
    for n in _sizes(world_size):
        reference = _input(rank, n)
        dist.all_reduce(reference)
        gathered = torch.empty(n * world_size)
        dist.all_gather_single(gathered, _input(rank, n))
        for name, algo in algos.items():
            for dtype in (torch.float32, torch.float64) if n == 1001 else (torch.float32,):
                x = _input(rank, n, dtype)
                result = algo.all_reduce(x).wait()
                assert result.data_ptr() == x.data_ptr() or n == 0  # summed in place
                out["reduce"][name, n, dtype] = (result.float(), reference)
            g = torch.empty(n * world_size)
            out["gather"][name, n] = (algo.all_gather(g, _input(rank, n)).wait(), gathered)
    # several calls queued before any is waited for complete in order, unmixed
    ring = algos["ring"]
    futures = [ring.all_reduce(_input(rank, 300 + i)) for i in range(5)]
    out["queued"] = [f.wait() for f in futures]
    return out


def _check_every_algorithm(results: list[dict], world_size: int) -> None:
    for rank, r in enumerate(results):
        for (name, n, dtype), (got, want) in r["reduce"].items():
            assert got.shape == (n,), (name, n)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{name} n={n} {dtype}")
            if name != "flat":  # our algorithms leave every rank with the very same bits
                assert torch.equal(got, results[0]["reduce"][name, n, dtype][0]), (name, n, rank)
        for (name, n), (got, want) in r["gather"].items():
            assert torch.equal(got, want), (name, n)
        for i, got in enumerate(r["queued"]):
            want = sum(_input(q, 300 + i) for q in range(world_size))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world_size", [2, 3])  # 4 ranks: in the two-node test below (a world costs seconds)
def test_each_collective_equals_the_backends_all_reduce_and_all_gather(world_size):
    _check_every_algorithm(run_ranks(_every_algorithm, world_size=world_size, timeout_s=90), world_size)


# -- hierarchical with a codec, and DDP (2 nodes x 2 ranks) ----------------------------------------

# Codecs whose hierarchical result equals their flat result: encoding is linear in the
# gradient, so encoding each node's sum and summing equals summing every rank's encoding:
# casts (up to their rounding), random-k (the same shared indices everywhere: exact),
# PowerSGD (P = sum M_r Q and Q = sum M_r^T P are linear in M; equal on the first call,
# before warm starts and residuals differ). Top-k, sign and int8 are not linear (the k
# largest entries, signs and scales of a sum are not those of its parts): for them the
# hierarchical result is checked against its own definition, sum over nodes of
# decode(encode(node sum)).
# name -> (options, tolerance relative to the largest entry: four ranks' roundings add up)
LINEAR = {"none": ({}, 1e-6), "fp16": ({}, 4 * 2**-11), "bf16": ({}, 4 * 2**-8), "randomk": ({"ratio": 0.2}, 1e-6),
          "powersgd": ({"rank": 4}, 1e-5)}
NONLINEAR = {"topk": {"ratio": 0.1}, "sign": {}, "int8": {"chunk_size": 100}}
N_CODEC = 64 * 32  # a 64 x 32 matrix for PowerSGD


def _codec_input(rank: int) -> torch.Tensor:
    # a low-rank matrix with a shared column space, so PowerSGD's error is small
    a = torch.randn(64, 3, generator=torch.Generator().manual_seed(5))
    b = torch.randn(3, 32, generator=torch.Generator().manual_seed(50 + rank))
    return (a @ b).view(-1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 2))


def _train(rank: int, config: CommConfig | None, topology: Topology, stats: dict | None = None) -> list[torch.Tensor]:
    ddp = DistributedDataParallel(_model(), bucket_cap_mb=0.005)  # three buckets
    state = None
    if config is not None:
        hook, state = build(config, topology=topology)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 2, generator=g)
        if state is not None:
            state.reset_step()
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if stats is not None:
        stats.update(raw=state.step_stats().raw_bytes, inter_node_wire=state.inter_node_stats().wire_bytes)
    return [p.detach().clone() for p in ddp.parameters()]


def _two_nodes(rank: int, world_size: int) -> dict:
    topology = _emulate_nodes(rank, world_size)
    hierarchical = Hierarchical(topology)
    out: dict = {"hier": {}, "flat": {}, "is_leader": topology.is_leader,
                 "algorithms": _every_algorithm(rank, world_size, topology)}
    for name, options in {**{k: v[0] for k, v in LINEAR.items()}, **NONLINEAR}.items():
        inter = make_reducer(codecs.make(name, **options), topology.leader_group) if topology.is_leader else None
        shapes = [torch.Size([64, 32])]  # PowerSGD compresses it as that matrix, both ways
        out["hier"][name] = HierarchicalReducer(hierarchical, inter).reduce(_codec_input(rank), key=0, weight=1.0,
                                                                            shapes=shapes).wait()
        if name in LINEAR:
            out["flat"][name] = make_reducer(codecs.make(name, **options)).reduce(_codec_input(rank), key=0,
                                                                                 weight=1.0, shapes=shapes).wait()
    # error feedback lives at the leaders only
    ef = codecs.ErrorFeedback(codecs.make("topk", ratio=0.1))
    inter = make_reducer(ef, topology.leader_group) if topology.is_leader else None
    HierarchicalReducer(hierarchical, inter).reduce(_codec_input(rank), key=0, weight=1.0).wait()
    out["residual_norm"] = float(ef.residual(0).norm()) if topology.is_leader else None
    # DDP through every algorithm, with and without a codec
    out["ddp"] = {"plain": _train(rank, None, topology)}
    for name in registry.COLLECTIVES:
        out["ddp"][name] = _train(rank, CommConfig(collective=name), topology)
    out["stats"] = {}
    for codec in ("fp16", "topk", "powersgd"):
        out["stats"][codec] = {}
        # segments smaller than a bucket: non-leaders must still follow the compressed path
        out["ddp"][f"hierarchical+{codec}"] = _train(
            rank, CommConfig(collective="hierarchical", codec=codec, topk_ratio=0.2, start_step=1, segment_bytes=512),
            topology, out["stats"][codec])
    topology.close()
    return out


def _decode_encode(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = codecs.make(name, **NONLINEAR[name])
    return codec.decode(codec.encode(x, key=0))


def test_two_nodes_of_two_ranks_every_collective_hierarchical_codecs_and_ddp():
    results = run_ranks(_two_nodes, world_size=4, timeout_s=150)
    _check_every_algorithm([r["algorithms"] for r in results], 4)
    for r in results:
        for name, (_, tolerance) in LINEAR.items():
            want = r["flat"][name]
            torch.testing.assert_close(r["hier"][name], want, atol=tolerance * float(want.abs().max()), rtol=0,
                                       msg=name)
        nodes = [[q for q in range(4) if _node(q, 4)[0] == node] for node in (0, 1)]
        for name in NONLINEAR:
            want = sum(_decode_encode(name, sum(_codec_input(q) for q in ranks)) for ranks in nodes)
            torch.testing.assert_close(r["hier"][name], want, atol=1e-5, rtol=1e-5, msg=name)
        for name, got in r["hier"].items():
            assert torch.equal(got, results[0]["hier"][name]), name
        assert (r["residual_norm"] is not None) == r["is_leader"]
    assert results[0]["residual_norm"] > 0  # top-k at 10% of a dense matrix leaves a residual
    for r in results:  # only leaders send between nodes, and less than the gradient
        for codec, stats in r["stats"].items():
            if r["is_leader"]:
                assert 0 < stats["inter_node_wire"] < stats["raw"], codec
            else:
                assert stats["inter_node_wire"] == 0, codec
    initial = list(_model().parameters())
    for name, params in results[0]["ddp"].items():
        assert any(not torch.equal(p, q) for p, q in zip(params, initial, strict=True)), name
        for r in results[1:]:
            for a, b in zip(params, r["ddp"][name], strict=True):
                assert torch.equal(a, b), name  # every rank ends with the same parameters
        if "+" not in name:  # uncompressed: plain DDP's parameters, up to summation order
            for a, b in zip(params, results[0]["ddp"]["plain"], strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_node_layout_groups_ranks_by_node_and_rejects_repeated_local_ranks():
    layout = NodeLayout.from_ranks([(1, 0), (0, 1), (1, 1), (0, 0)])
    assert layout.nodes == ((3, 1), (0, 2))
    assert layout.leaders == (3, 0)
    assert layout.max_ranks_per_node == 2
    with pytest.raises(ValueError, match="repeat"):
        NodeLayout.from_ranks([(0, 0), (0, 0)])


def test_collective_names_match_the_config_and_bad_names_are_rejected():
    assert tuple(collectives.COLLECTIVES) == tuple(registry.COLLECTIVES)
    with pytest.raises(ValueError, match="allowed are flat, ring"):
        collectives.make("butterfly")
    with pytest.raises(ValueError, match=r"comm\.collective='star'"):
        registry.check(CommConfig(collective="star"))
    with pytest.raises(ValueError, match="torch-fp16"):
        registry.check(CommConfig(collective="ring", codec="torch-fp16"))
