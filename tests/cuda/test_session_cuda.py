"""``poise.Session`` steps on a CUDA model: one rank on NCCL, and two ranks on gloo sharing a GPU.

NCCL is what GPU users run. A world of one on NCCL runs the whole session path on the device:
DDP with poise's comm hook behind the probe, the clock's CUDA events read one step late, the
recorder, the report. NCCL refuses two ranks on one GPU, so a world of two on one GPU runs on
gloo instead, which torch allows: gloo's ``ProcessGroupGloo`` has CUDA variants of broadcast,
all-reduce, reduce, all-gather (``all_gather_into_tensor`` goes through it), gather and
scatter, which stage the tensor through pinned host memory on a side stream
(``Async*CUDAWork`` in ``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``; the backend table
of torch's distributed docs), while send and recv take CPU tensors only. poise's flat reducers
use all-reduce and all-gather, the session's report gathers CPU tensors and objects, so the
whole step runs; only the ring and tree collectives (send/recv) would need CPU tensors. On gloo
the reduced gradient of unequal batches must equal the gradient of the whole step.
"""

from __future__ import annotations

import pytest
import torch

import poise
from tests.cuda.common import CUDA, SyncCounter, run_nccl
from tests.cuda.workload import LENGTHS, Rows, collate, make_model, token_mean_loss, whole_step_grads
from tests.harness import run_ranks

pytestmark = CUDA

CODECS = ("none", "fp16", "topk", "powersgd")
STEPS = 6


def _steps(rank: int, world_size: int, comm: str) -> dict:
    """STEPS steps of a session on this rank's GPU; the first step's reduced gradient, the
    whole step's reference gradient, syncs counted, the report."""
    from poise.runtime.clock import CudaClock

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    data = poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=8, dataset=Rows())
    session = poise.Session(make_model(device), data, balance="cost",
                            comm=poise.CommConfig(codec=comm, start_step=0))
    loader = session.dataloader(Rows(), collate_fn=collate, pin_memory=True)
    optimizer = torch.optim.SGD(session.model.parameters(), lr=0.05)
    out: dict = {"records": [], "clock": type(session.clock) is CudaClock, "kept": session.freed_memory is not None}
    with SyncCounter() as syncs:
        for step, (x, y) in session.steps(loader):
            step.backward(token_mean_loss(session.model, x.to(device, non_blocking=True),
                                          y.to(device, non_blocking=True)))
            if step.index == 0:
                out["grads"] = [p.grad.detach().cpu() for p in session.model.parameters()]
                out["indices"] = [b.tolist() for b in session.sampler.global_batches(step.position)]
            optimizer.step()
            optimizer.zero_grad()
            record = session.last_record
            out["records"].append(record.step if record is not None else None)
            if step.index == STEPS - 1:
                break
    out["syncs"] = syncs.count
    out["params"] = [p.detach().cpu() for p in session.model.parameters()]
    out["on_device"] = all(p.device == device for p in session.model.parameters())
    out["reference"] = [g.cpu() for g in whole_step_grads(device, out["indices"])]
    out["report"] = session.finish()
    return out


def _check(results: list[dict], comm: str, backend: str) -> None:
    for r in results:
        assert r["clock"] and r["on_device"]
        assert r["syncs"] == 0  # no torch.cuda.synchronize() in a hook or a step
        # CUDA events are read a step late: step i-1's when step i closes, so inside step i the
        # latest record is step i-2's (on the CPU's host clock it would be step i-1's)
        assert r["records"] == [None, None, *range(STEPS - 2)]
        assert not r["kept"]  # keep_freed_memory=None leaves a CUDA run's malloc alone
        assert all(torch.isfinite(p).all() for p in r["params"])
    first = results[0]
    for other in results[1:]:  # every rank holds the same reduced gradient and the same weights
        for a, b in zip(first["grads"], other["grads"], strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    if comm == "none":  # exact weighting of unequal batches: the whole step's gradient
        for got, want in zip(first["grads"], first["reference"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    report = first["report"]
    assert report["backend"] == backend and report["world_size"] == len(results)
    assert report["steps"] == STEPS and report["codec"] == comm
    assert report["per_rank"][0]["median_compute_s"] > 0
    assert report["memory"][0]["kept"] is False


@pytest.mark.parametrize("comm", CODECS)
def test_a_session_on_nccl_times_with_events_and_reduces_exactly(comm):
    _check(run_nccl(_steps, world_size=1, timeout_s=180, comm=comm), comm, "nccl")


@pytest.mark.dist
@pytest.mark.parametrize("comm", CODECS)
def test_two_gloo_ranks_on_one_gpu_reduce_cuda_gradients_exactly(comm):
    _check(run_ranks(_steps, world_size=2, timeout_s=180, comm=comm), comm, "gloo")


def _kept(rank: int, world_size: int, keep: bool | None) -> dict:
    """What ``keep_freed_memory`` does with a CUDA model: nothing unless asked for."""
    from poise.runtime import memory

    device = torch.device("cuda", torch.cuda.current_device())
    calls: list[tuple] = []
    real = memory.keep_freed_memory
    memory.keep_freed_memory = lambda *a, **k: (calls.append(a), real(*a, **k))[1]  # noted, then done
    try:
        session = poise.Session(make_model(device), poise.Data(lengths=LENGTHS, batch_size=8), keep_freed_memory=keep)
    finally:
        memory.keep_freed_memory = real
    return {"policy": session.freed_memory is not None, "calls": len(calls)}


@pytest.mark.parametrize(("keep", "kept"), [(None, False), (False, False), (True, True)])
def test_keep_freed_memory_leaves_a_cuda_run_alone_unless_asked(keep, kept):
    (result,) = run_nccl(_kept, world_size=1, timeout_s=120, keep=keep)
    assert result["policy"] is kept
    assert result["calls"] == int(kept)  # mallopt is never touched for a GPU run by default
