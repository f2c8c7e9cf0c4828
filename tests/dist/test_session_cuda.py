"""The session's CUDA path: clock marks are CUDA events, read a step later, and nothing in a
gradient bucket's hook waits for the device (which would stop communication overlapping
backward). Runs where CUDA is present; skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import poise
from tests.harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_steps(rank: int, world_size: int) -> dict:
    from poise.runtime.clock import CudaClock

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
    lengths = np.full(64, 8)
    session = poise.Session(model, poise.Data(lengths=lengths, batch_size=8), balance="cost")
    syncs = []
    real_sync = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: (syncs.append(1), real_sync(*a, **k))[1]  # count device-wide syncs
    try:
        records = []
        for step, _ in session.steps(iter(session.sampler)):
            x = torch.randn(8, 256, device=device)
            step.backward(model(x).square().mean())
            records.append(session.last_record)
            if step.index == 4:
                break
    finally:
        torch.cuda.synchronize = real_sync
    report = session.finish()
    return {"clock": type(session.clock) is CudaClock, "syncs": len(syncs), "lagged": records[0] is None,
            "report": report}


def test_cuda_steps_are_timed_with_events_without_device_syncs():
    (result,) = run_ranks(_cuda_steps, world_size=1, timeout_s=120)
    assert result["clock"]
    assert result["syncs"] == 0  # no torch.cuda.synchronize() in the hook or the step
    assert result["lagged"]  # a step's events are read after the next step
    report = result["report"]
    assert report["steps"] == 5
    assert report["per_rank"][0]["median_compute_s"] > 0
