"""The timing probe on CUDA: marks are events stamped by the device, read after the step, and
nothing in a gradient bucket's hook waits for the device.

A ``torch.cuda.synchronize()`` (or any synchronizing op) in DDP's comm hook would stall the
queue behind it, so communication could no longer overlap backward; the probe therefore only
records events (``poise/runtime/clock.py``, ``poise/comm/probe.py``). Checked here with torch's
own detector (``torch.cuda.set_sync_debug_mode``): a backward with poise's hook behind the
probe (uncompressed, and fp16 and top-k behind error feedback) raises no more synchronization
warnings than plain DDP's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.cuda.common import CUDA, SyncCounter, run_nccl

pytestmark = CUDA

SLEEP_CYCLES = 1_000_000_000  # about half a second of a GPU's clock: the host is far ahead of it


def test_a_cuda_mark_is_stamped_by_the_device_not_the_host():
    from poise.runtime.clock import CudaClock, clock_for

    device = torch.device("cuda", torch.cuda.current_device())
    clock = clock_for(device)
    assert isinstance(clock, CudaClock)
    start = clock.mark()
    torch.cuda._sleep(SLEEP_CYCLES)  # a kernel that keeps the device busy
    end = clock.mark()
    assert not clock.ready(end)  # the host got here long before the device will
    seconds = clock.seconds(start, end)  # waits for the event: only ever after a step
    assert clock.ready(end) and seconds > 0


def _sync_warnings(backward: Callable[[], None]) -> int:
    """Synchronization warnings torch's detector raises while ``backward`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _probe(rank: int, world_size: int, codec: str) -> dict:
    import poise.comm
    from poise.comm.probe import BucketProbe, instrumented
    from poise.runtime.clock import CudaClock

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(6))).to(device)
    plain = DistributedDataParallel(model, device_ids=[device.index], bucket_cap_mb=1)
    hooked = DistributedDataParallel(nn.Sequential(*(nn.Linear(512, 512) for _ in range(6))).to(device),
                                     device_ids=[device.index], bucket_cap_mb=1)
    clock = CudaClock(device)
    probe = BucketProbe(clock)
    compress = poise.comm.hook(codec, start_step=0)  # compressing from the first step, error feedback on
    hooked.register_comm_hook(None, instrumented(compress, probe))
    x = torch.randn(64, 512, device=device)
    for ddp in (plain, hooked):  # the first backward builds buckets: warm both up
        ddp(x).square().mean().backward()
    torch.cuda.synchronize()
    plain_syncs = _sync_warnings(lambda: plain(x).square().mean().backward())
    probe.reset()
    compress.state.reset_step()
    origin = clock.mark()
    with SyncCounter() as explicit:
        hooked_syncs = _sync_warnings(lambda: hooked(x).square().mean().backward())
    end = clock.mark()
    busy, hidden = probe.comm_overlap(end, origin)  # reads the events: after the step
    return {"plain_syncs": plain_syncs, "hooked_syncs": hooked_syncs, "explicit": explicit.count,
            "buckets": probe.buckets_this_step, "in_flight": len(probe.in_flight),
            "events": all(isinstance(m, torch.cuda.Event) for pair in probe.in_flight for m in pair),
            "busy": busy, "hidden": hidden}


@pytest.mark.parametrize("codec", ["none", "fp16", "topk"])
def test_the_probe_records_events_in_the_hook_and_never_synchronizes(codec):
    """With codecs too: the codec and error feedback run in the hook (on DDP's autograd thread)."""
    (r,) = run_nccl(_probe, world_size=1, timeout_s=120, codec=codec)
    assert r["buckets"] > 1 and r["in_flight"] == r["buckets"] and r["events"]
    assert r["explicit"] == 0
    assert r["hooked_syncs"] <= r["plain_syncs"], (
        f"poise's hook, codec or probe synchronizes with the device: {r['hooked_syncs']} synchronizing "
        f"operations against plain DDP's {r['plain_syncs']}")
    assert r["busy"] >= r["hidden"] >= 0
