"""What the ``cuda`` tests share: the skip without a device, and one rank on NCCL.

Every test here is marked ``cuda`` and skipped, with the reason, where torch sees no CUDA
device (``make test`` on a CPU machine collects and skips them; ``make gpu-check`` runs them
on a lent GPU). Multi-process tests run real ranks: gloo ones through ``tests/harness.py``;
NCCL ones through :func:`run_nccl`, the same harness with NCCL as the backend (a world of one:
NCCL refuses two ranks on one GPU, "Duplicate GPU detected").
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (make gpu-check runs these on a GPU)"
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


def _child(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float, results: Any,
           kwargs: dict[str, Any]) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)  # NCCL's collectives and all_gather_object use the current device
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device)
    try:
        results.put((rank, pickle.dumps(fn(rank, world_size, **kwargs))))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    os._exit(0)


def run_nccl(fn: Callable[..., Any], world_size: int = 1, timeout_s: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` NCCL ranks (one GPU each) and
    return their results in rank order; bounded by ``timeout_s`` (see ``tests/harness.py``)."""
    if world_size > torch.cuda.device_count():
        pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs; torch sees {torch.cuda.device_count()}")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    results = mp.get_context("spawn").SimpleQueue()
    procs = mp.spawn(_child, args=(fn, world_size, store.port, timeout_s, results, kwargs), nprocs=world_size,
                     join=False)
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    while not procs.join(timeout=0.2):
        while not results.empty():
            rank, value = results.get()
            out[rank] = pickle.loads(value)
        if time.monotonic() > deadline:
            alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"NCCL ranks {alive} still running after {timeout_s} s")
    while not results.empty():
        rank, value = results.get()
        out[rank] = pickle.loads(value)
    del store
    return [out[r] for r in range(world_size)]


class SyncCounter:
    """Counts ``torch.cuda.synchronize()`` calls while active (a context manager).

    Why a wrapper: a device-wide synchronize in a gradient bucket's hook would stop
    communication overlapping backward; nothing in poise's step may call it. (Replaced only
    inside the test's own process, for the block's duration.)
    """

    def __init__(self) -> None:
        self.count = 0
        self._real: Callable[..., None] | None = None

    def __enter__(self) -> SyncCounter:
        self._real = real = torch.cuda.synchronize

        def counted(*args: Any, **kwargs: Any) -> None:
            self.count += 1
            real(*args, **kwargs)

        torch.cuda.synchronize = counted
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._real is not None
        torch.cuda.synchronize = self._real
