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


def _auto(rank: int, world_size: int, keep: bool) -> dict:
    """comm.codec=auto's dry runs over several buckets: until the choice every step is the
    uncompressed one, so a dropped codec leaves DDP bit-identical to the plain hook, and the
    dry runs leave no residual or warm start behind for a kept one. A kept one's compressed steps
    6 to 8 are told to take as long as the uncompressed ones: it is dropped from step 9."""
    import copy

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from poise.comm.adapter import compressed_hook
    from poise.comm.trial import CodecTrial

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    runs = {}
    for name in ("auto", "none"):
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.01)  # a bucket per layer or so
        trial = CodecTrial(5, steps=3) if name == "auto" else None
        options = {"rank": 2} if trial else {}
        state = poise.comm.make_state("powersgd" if trial else "none", start_step=5, trial=trial, **options)
        ddp.register_comm_hook(state, compressed_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        wire, dry_runs = [], []
        for step in range(11):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)
            optimizer.zero_grad()
            state.reset_step()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
            wire.append(state.step_stats().wire_bytes)
            if trial is not None:  # what the session does: the step's seconds, then the dry run
                trial.observe(step, 1.0, 0.9 if keep else 0.0)  # keep: 90 % of the step waits for the link
                dry_runs.append(state.between_steps())
                if step == 4:
                    runs["codec_state_at_choice"] = state.codec.state_dict()
        runs[name] = {"params": [p.detach().clone() for p in ddp.parameters()], "wire": wire, "dry_runs": dry_runs,
                      "buckets": state.step_stats().buckets, "choice": trial.choice if trial else None,
                     "dropped": trial.dropped_step if trial else None}
    return runs


@pytest.mark.parametrize("keep", [False, True])
def test_auto_decides_on_dry_runs_that_change_nothing(keep):
    results = run_ranks(_auto, world_size=2, timeout_s=120, keep=keep)
    for r in results:
        auto, none = r["auto"], r["none"]
        assert auto["buckets"] > 1 and auto["choice"] is keep
        # dry runs after steps 2-4; a kept codec judged by its measured steps after step 8
        assert auto["dry_runs"] == [False, False, True, True, True, False, False, False, keep, False, False]
        assert auto["wire"][:5] == none["wire"][:5]  # uncompressed until the choice
        state = r["codec_state_at_choice"]
        assert state["residuals"] == {} and state["codec"]["q"] == {}  # the dry runs left nothing behind
        if keep:
            assert all(a < b for a, b in zip(auto["wire"][5:9], none["wire"][5:9], strict=True))
            assert auto["dropped"] == 9 and auto["wire"][9:] == none["wire"][9:]  # not 1.25x faster: exact again
        else:
            assert auto["wire"] == none["wire"]
            for a, b in zip(auto["params"], none["params"], strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)  # bit-identical to the plain hook
