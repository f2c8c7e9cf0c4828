"""FSDP2 and HSDP through poise (``poise.sync.Sharded``, ``poise.comm.sharded``) on real gloo ranks.

Exact gradients with unequal batches (with and without accumulation) against one process's
gradient of the union of the batches; the reduce-scatter with a codec against the plain one
(casts bit for bit on values they represent exactly, int8 within its error bound, error
feedback carrying what was not sent); HSDP with poise's codec on the replicate all-reduce
against native HSDP; the one-line refusals.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import poise
from poise.comm.codecs import ErrorFeedback, make
from poise.comm.sharded import BlockingProbe, ShardedComm, ShardedReduceScatter
from poise.runtime.clock import HostClock
from tests.dist.test_session import LENGTHS, Sequences, collate, token_mean_loss
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

SPEEDS = {2: [1.0, 3.0], 4: [1.0, 3.0, 1.0, 2.0]}  # unequal shares: unequal batches


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _sharded(mesh) -> nn.Module:
    """Blocks 0 and 2 sharded on their own; the root holds the head's parameters (as a model's
    embeddings and head usually are)."""
    return _shard(_model(), mesh)


def _shard(model: nn.Module, mesh) -> nn.Module:
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


LR = 0.1


def _one_step(model: nn.Module, world_size: int, comm: poise.CommConfig, accum_steps: int = 1) -> dict:
    """One optimizer step of ``model`` through a session: the step's batches, the reduced
    gradient and the parameters after SGD (both whole, gathered), the probe's reductions per
    micro-batch and the step's traffic."""
    data = poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_cost=world_size * 6 * 20.0,
                      accum_steps=accum_steps, dataset=Sequences())
    session = poise.Session(model, data, balance="cost", comm=comm)
    assert session.model is model and session.module is model
    session.sampler.set_speeds(SPEEDS[world_size])
    optimizer = torch.optim.SGD(session.model.parameters(), lr=LR)
    out: dict = {"steps": [], "reductions": []}
    for step, (x, y) in session.steps(session.dataloader(Sequences(), collate_fn=collate)):
        step.backward(token_mean_loss(session.model, x, y))
        out["steps"].append([b.tolist() for b in session.sampler.global_batches(step.position)])
        out["reductions"].append(session.sync.probe.buckets_this_step)
        if step.sync:
            out["grads"] = [p.grad.full_tensor() for p in model.parameters()]
            out["traffic"] = session.sync.traffic()
            optimizer.step()
            out["params"] = [p.full_tensor().detach() for p in model.parameters()]
            out["summary"] = session.sync.summary()
            break
    # the step's record: the reductions blocked this thread (on the CPU), after its own compute
    out["record"] = session.last_record
    # this rank's state (error-feedback residuals) through a checkpoint's round trip
    buffer = io.BytesIO()
    torch.save(session.state_dict(), buffer)
    buffer.seek(0)
    out["state"] = torch.load(buffer, weights_only=True)["comm"]
    session.sync.load_state_dict(out["state"])
    out["restored"] = session.sync.state_dict()
    return out


def _reference(steps: list, accum_steps: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process's gradient of the union of every rank's batches, and its parameters after SGD."""
    model = _model()
    for batches in steps:
        x, y = collate([Sequences()[i] for b in batches for i in b])
        (token_mean_loss(model, x, y) / accum_steps).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _fsdp(rank: int, world_size: int, codec: str, accum_steps: int) -> dict:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0")  # a node each: every byte crosses nodes
    mesh = init_device_mesh("cpu", (world_size,))
    return _one_step(_sharded(mesh), world_size, poise.CommConfig(codec=codec, start_step=0, error_feedback=False),
                     accum_steps)


# bytes of the three layers' reduce-scatter inputs on 2 ranks (dim 0 padded to even):
# (16x4 + 16) + (16x16 + 16) + (2x16 + 2) fp32 entries
RS_BYTES = (80 + 272 + 34) * 4


@pytest.mark.parametrize(("codec", "accum_steps", "rtol"), [("none", 1, 1e-5), ("none", 2, 1e-5), ("fp16", 1, 3e-3),
                                                             ("bf16", 1, 2e-2)])
def test_fsdp_with_unequal_batches_gives_the_gradient_of_the_union(codec, accum_steps, rtol):
    """FSDP2 through a session: the reduced gradient (and the parameters after one SGD step)
    are one process's on the union of the ranks' unequal batches; with accumulation nothing
    is reduced before the window's last micro-batch."""
    results = run_ranks(_fsdp, world_size=2, timeout_s=120, codec=codec, accum_steps=accum_steps)
    steps = results[0]["steps"]
    assert steps == results[1]["steps"] and len(steps) == accum_steps
    assert any(len(a) != len(b) for a, b in steps)  # the batches really are unequal
    grads, params = _reference(steps, accum_steps)
    for r in results:
        assert r["reductions"] == [0] * (accum_steps - 1) + [3]  # one reduce-scatter per layer, at the last only
        for got, want in zip(r["grads"], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)
        for got, want, grad in zip(r["params"], params, grads, strict=True):  # the step moves by lr x grad
            torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6 + LR * rtol * float(grad.abs().max()))
        stats, inter = r["traffic"]
        assert stats.buckets == 3 and inter == stats  # a node per rank: all of FSDP's traffic crosses nodes
        # parameter all-gathers count alike in raw and wire: the difference is the codec's saving
        assert stats.raw_bytes - stats.wire_bytes == {"none": 0, "fp16": RS_BYTES // 2, "bf16": RS_BYTES // 2}[codec]
        assert r["summary"]["mode"] == "fsdp" and r["summary"]["shard_size"] == 2
        record = r["record"]
        assert record.comm_busy_s > 0 and record.comm_hidden_s == 0  # nothing overlaps a blocking reduction
        assert record.comm_wait_s >= record.comm_busy_s  # its seconds are out of the compute


# -- the reduce-scatter alone -----------------------------------------------------------------------

CHUNK = 2500  # entries of each rank's output: three int8 scale chunks, the last one short


def _reduce_scatter(rank: int, world_size: int, codec: str, inputs: list[torch.Tensor], start_step: int = 0) -> dict:
    """``inputs[i]`` reduce-scattered as optimizer step i (``start_step`` of them uncompressed)."""
    comm = ShardedComm(BlockingProbe(HostClock()), start_step=start_step, node_of=[0] * world_size)
    comm.expected = True
    made = make(codec)
    rs = ShardedReduceScatter(comm, ErrorFeedback(made) if codec in ("int8", "topk") else made, "layer")
    outs, stats = [], []
    for step, x in enumerate(inputs):
        comm.step = step
        comm.reset_step()
        out = torch.empty(CHUNK)
        rs(out, x[rank].clone(), dist.group.WORLD, dist.ReduceOp.SUM)
        outs.append(out)
        stats.append(comm.step_stats())
    codec_ = rs.codec
    residuals = ([codec_.residual(f"layer/{r}").clone() for r in range(world_size)]
                 if isinstance(codec_, ErrorFeedback) else None)
    return {"outs": outs, "residuals": residuals, "stats": stats}


def _dyadic(world_size: int, seed: int) -> torch.Tensor:
    """Per rank, k/64 with |k| < 64: exact in fp16 and bf16, and so are sums of four."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-63, 64, (world_size, world_size * CHUNK), generator=g).float() / 64


def _exact(inputs: torch.Tensor, rank: int) -> torch.Tensor:
    return inputs.sum(0)[rank * CHUNK: (rank + 1) * CHUNK]


@pytest.mark.parametrize("world_size", [2, 4])
def test_cast_reduce_scatter_is_bit_for_bit_on_values_it_represents(world_size):
    """fp16 and bf16 reduce-scatters of values (and sums) both types represent exactly equal
    the fp32 one bit for bit; on random values they stay within the cast's rounding."""
    exact_inputs = _dyadic(world_size, 1)
    noisy = torch.randn(world_size, world_size * CHUNK, generator=torch.Generator().manual_seed(2))
    for codec, unit_roundoff in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        results = run_ranks(_reduce_scatter, world_size=world_size, timeout_s=90, codec=codec,
                            inputs=[exact_inputs, noisy])
        for rank, r in enumerate(results):
            assert torch.equal(r["outs"][0], _exact(exact_inputs, rank)), codec
            want = _exact(noisy, rank)
            assert not torch.equal(r["outs"][1], want)  # the cast did round
            # each addend rounded once (n of at most max|x|), each partial sum of k addends once
            # (at most k max|x|, k = 2..n): the worst case of a sum in the wire dtype
            bound = (world_size + world_size * (world_size + 1) / 2) * noisy.abs().max() * unit_roundoff
            assert (r["outs"][1] - want).abs().max() <= bound, codec
            assert all(stats.wire_bytes * 2 == stats.raw_bytes for stats in r["stats"])


def test_the_first_steps_are_reduced_uncompressed():
    """Before ``start_step`` the plain fp32 reduce-scatter runs (bit for bit a plain sum of two,
    full bytes); from it on, the codec."""
    noisy = torch.randn(2, 2 * CHUNK, generator=torch.Generator().manual_seed(4))
    for rank, r in enumerate(run_ranks(_reduce_scatter, world_size=2, timeout_s=90, codec="fp16",
                                       inputs=[noisy, noisy], start_step=1)):
        assert torch.equal(r["outs"][0], _exact(noisy, rank)) and not torch.equal(r["outs"][1], _exact(noisy, rank))
        assert r["stats"][0].wire_bytes == r["stats"][0].raw_bytes == 2 * r["stats"][1].wire_bytes


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_compressed_reduce_scatter_carries_its_error_to_the_next_step(codec):
    """int8 with error feedback: each output entry is within the sum of the ranks' half
    quantization steps of the exact sum (int8's bound), and over steps nothing is lost: the
    outputs plus the residuals still held for this rank's chunk are the exact sums (also
    top-k, through the same all-to-all)."""
    world_size = 2
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(world_size, world_size * CHUNK, generator=g) for _ in range(3)]
    results = run_ranks(_reduce_scatter, world_size=world_size, timeout_s=90, codec=codec, inputs=inputs)
    for rank, r in enumerate(results):
        if codec == "int8":  # the first step has no residual yet: the plain quantization bound
            first = inputs[0][:, rank * CHUNK: (rank + 1) * CHUNK]
            blocks = torch.split(first, 1024, dim=1)
            bound = torch.cat([b.abs().amax(1, keepdim=True).expand_as(b) for b in blocks], 1).sum(0) / 254
            error = (r["outs"][0] - first.sum(0)).abs()
            assert bool((error <= bound * (1 + 1e-5)).all()) and error.max() > 0
        held = sum(other["residuals"][rank] for other in results)
        assert held.abs().max() > 0
        torch.testing.assert_close(sum(r["outs"]) + held, sum(_exact(x, rank) for x in inputs), rtol=0, atol=1e-4)
        assert all(stats.wire_bytes < stats.raw_bytes / 3 for stats in r["stats"])


# -- HSDP ---------------------------------------------------------------------------------------------


def _hsdp(rank: int, world_size: int) -> dict:
    """Native 2-D HSDP, then HSDP sharded on mesh['shard'] with poise's all-reduce between the
    two emulated nodes (none, fp16, int8, PowerSGD), each one optimizer step from the same start."""
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))  # nodes {0, 1} and {2, 3}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {"native": _one_step(_sharded(mesh), world_size, poise.CommConfig(codec="none"))}
    out["native-fp16"] = _one_step(_sharded(mesh), world_size, poise.CommConfig(codec="fp16", start_step=0))
    for codec in ("none", "fp16", "int8", "powersgd"):
        comm = poise.CommConfig(codec=codec, start_step=0, powersgd_rank=1)
        out[codec] = _one_step(_sharded(mesh["shard"]), world_size, comm)
    return out


def test_hsdp_with_a_codec_between_nodes_equals_native_hsdp_within_the_codec():
    """4 ranks as 2 nodes x 2: native HSDP's gradient is one process's on the union; poise's
    replicate all-reduce with no codec gives it bit for bit, fp16 within its rounding, int8
    within a few of its quantization steps, PowerSGD (rank 1) compressed with a residual per
    module's shard; only the replicate all-reduce's bytes cross nodes."""
    results = run_ranks(_hsdp, world_size=4, timeout_s=240)
    steps = results[0]["native"]["steps"]
    assert all(r[k]["steps"] == steps for r in results for k in r)  # every run planned the same step
    grads, params = _reference(steps)
    for r in results:
        native = r["native"]
        for got, want in zip(native["grads"], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(native["params"], params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert native["summary"] == {"mode": "hsdp", "native": True, "codec": "none", "codec_on": "reduce-scatter",
                                     "shard_size": 2, "replicate_size": 2}
        for got, want in zip(r["native-fp16"]["grads"], grads, strict=True):
            torch.testing.assert_close(got, want, rtol=3e-3, atol=1e-6)
        for got, want in zip(r["none"]["grads"], native["grads"], strict=True):
            assert torch.equal(got, want)
        for got, want in zip(r["fp16"]["grads"], native["grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=3e-3, atol=1e-6)
        for got, want in zip(r["int8"]["grads"], native["grads"], strict=True):
            scale = want.abs().max()
            assert (got - want).abs().max() <= 4 * scale / 127
        psgd = r["powersgd"]
        assert any(not torch.equal(a, b) for a, b in zip(psgd["grads"], native["grads"], strict=True))
        # a residual per module's shard (the root's, the head's 1x16 shard, is sent whole: nothing to compress)
        assert sorted(psgd["state"]["codec"]["residuals"]) == ["0", "2"]
        int8 = r["int8"]  # residuals per module (the root's too), kept through a checkpoint's round trip
        assert sorted(int8["state"]["codec"]["residuals"]) == ["0", "2", "root"]
        residuals = int8["state"]["codec"]["residuals"]
        assert residuals["0"].abs().max() > 0  # (the head's shard is padding alone on half the ranks: zero)
        assert all(torch.equal(int8["restored"]["codec"]["residuals"][k], v) for k, v in residuals.items())
        # bytes: the replicate all-reduce crosses nodes, the shard group's gathers and scatters do not
        stats, inter = r["none"]["traffic"]
        assert 0 < inter.raw_bytes < stats.raw_bytes
        _, native_inter = native["traffic"]
        assert native_inter.raw_bytes == inter.raw_bytes  # the same all-reduce, counted alike
        assert r["int8"]["traffic"][1].wire_bytes < inter.wire_bytes / 3


# -- refusals -----------------------------------------------------------------------------------------


def _refusals(rank: int, world_size: int) -> dict:
    out = {}
    mesh = init_device_mesh("cpu", (world_size,))
    data = poise.Data(lengths=LENGTHS, batch_size=4)
    for name, kwargs in {"deadline": {"straggler": "deadline"}, "outer": {"sync": "local_sgd"},
                         "powersgd": {"comm": poise.CommConfig(codec="powersgd", start_step=0)},
                         "auto": {"comm": poise.CommConfig(codec="auto", start_step=0)}}.items():
        with pytest.raises(ValueError) as err:
            poise.Session(_sharded(mesh), data, **kwargs)
        out[name] = str(err.value)
    mesh2 = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError) as err:
        poise.Session(_sharded(mesh2), data, comm=poise.CommConfig(codec="int8"))
    out["native-int8"] = str(err.value)
    session = poise.Session(_sharded(mesh), data)
    params = list(session.model.parameters())  # the sharded parameters, which an optimizer holds
    x, y = collate([Sequences()[i] for i in range(4)])
    with pytest.raises(ValueError) as err:
        token_mean_loss(session.model, x, y).backward()  # not step.backward: refused before any gradient lands
    out["outside"] = str(err.value)
    out["grads"] = [p.grad is None for p in params]
    # an optimizer built before fully_shard holds the replaced tensors: its steps would train nothing
    model = _model()
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    late = poise.Session(_shard(model, mesh), data)
    for step, batch in late.steps(late.dataloader(Sequences(), collate_fn=collate)):
        step.backward(token_mean_loss(late.model, *batch))
        if step.index == 0:  # the first step is watched
            with pytest.raises(ValueError) as err:
                stale.step()
            out["stale"] = str(err.value)
            torch.optim.SGD(late.model.parameters(), lr=0.1).step()  # one built after passes
        else:
            stale.step()  # later steps are not watched: they pay nothing
            break
    return out


def test_what_cannot_run_sharded_is_refused_in_one_line():
    for r in run_ranks(_refusals, world_size=2, timeout_s=120):
        assert "straggler.mode='deadline'" in r["deadline"] and "straggler='off'" in r["deadline"]
        assert "sync.mode='local_sgd'" in r["outer"] and "sync='step'" in r["outer"]
        assert "powersgd" in r["powersgd"] and "mesh['shard']" in r["powersgd"]
        assert "comm.codec='auto'" in r["auto"]
        assert "native HSDP" in r["native-int8"] and "mesh['shard']" in r["native-int8"]
        assert "outside step.backward(loss)" in r["outside"]
        assert all(r["grads"])
        assert "holds none of the sharded model's parameters" in r["stale"] and "after fully_shard" in r["stale"]
        assert all("\n" not in message for message in r.values() if isinstance(message, str))
