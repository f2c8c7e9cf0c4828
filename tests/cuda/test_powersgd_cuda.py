"""PowerSGD's communication thread (``wrappers.OnCommThread``) with CUDA tensors and streams.

The thread runs each bucket's two all-reduce rounds and factor products off DDP's autograd
thread. On CUDA its job first waits, on the device, for the stream the caller produced the
gradient on (an event recorded at submission), and synchronizes its own stream before it
completes the future (``poise/comm/topology.py``, ``CommThread``). Checked here: a gradient
still being written by a long kernel on a side stream when it is handed over is reduced as
written, not as it was before; the caller never waits; several buckets in flight stay matched;
and error feedback's invariant holds (the reduced gradient is the sum over ranks of
``corrected - residual``), on two gloo ranks sharing a GPU and on one NCCL rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.cuda.common import CUDA, run_nccl
from tests.harness import run_ranks

pytestmark = CUDA

SHAPES = {0: [(64, 96), (96,), (48, 128)], 1: [(256, 32), (32,)], 2: [(96, 160), (160, 96), (7,)]}
SLEEP_CYCLES = 200_000_000  # keeps the side stream busy while the reduction is handed over


def _x(rank: int, key: int, call: int) -> torch.Tensor:
    numel = sum(math.prod(s) for s in SHAPES[key])
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * rank + 10 * key + call))


def _ranks(rank: int, world_size: int) -> dict:
    import poise.comm

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    state = poise.comm.make_state("powersgd", rank=2, start_step=0)
    ef = state.codec
    side = torch.cuda.Stream(device)
    out: dict = {"reducer": repr(state.reducer), "calls": []}
    for call in range(2):
        before = {k: (ef.residual(k).cpu().clone() if ef.residual(k) is not None else torch.zeros_like(_x(0, k, 0)))
                  for k in SHAPES}
        grads = {k: torch.zeros(_x(rank, k, call).numel(), device=device) for k in SHAPES}
        futures = {}
        with torch.cuda.stream(side):  # the gradient is produced on a side stream, after a long kernel
            for k in SHAPES:
                torch.cuda._sleep(SLEEP_CYCLES)
                grads[k].copy_(_x(rank, k, call).to(device, non_blocking=True))
                futures[k] = state.reducer.reduce(grads[k], key=k, shapes=SHAPES[k])
        pending = [not f.done() for f in futures.values()]  # handed over; nothing waited for the device
        results = {k: f.wait().cpu() for k, f in futures.items()}
        sent = {k: _x(rank, k, call) / world_size + before[k] - ef.residual(k).cpu() for k in SHAPES}
        out["calls"].append({"pending": pending, "results": results, "sent": sent,
                             "on_device": all(ef.residual(k).device == device for k in SHAPES)})
    dist.barrier()
    return out


def _check(results: list[dict]) -> None:
    assert results[0]["reducer"].startswith("OnCommThread(LowRankReducer(")
    for call in range(2):
        assert results[0]["calls"][call]["pending"][0]  # the first bucket was still on the device when handed over
        assert all(r["calls"][call]["on_device"] for r in results)
        for key in SHAPES:
            got = [r["calls"][call]["results"][key] for r in results]
            for other in got[1:]:
                torch.testing.assert_close(other, got[0], atol=0, rtol=0)
            want = sum(r["calls"][call]["sent"][key] for r in results)
            torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4, msg=f"call {call} bucket {key}")


@pytest.mark.dist
def test_powersgd_on_its_thread_with_cuda_streams_over_gloo():
    _check(run_ranks(_ranks, world_size=2, timeout_s=120))


def test_powersgd_on_its_thread_with_cuda_streams_over_nccl():
    _check(run_nccl(_ranks, world_size=1, timeout_s=120))
