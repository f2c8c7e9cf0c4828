"""torch's own fp16 and PowerSGD comm hooks behind poise's state protocol, for comparison.

:class:`TorchHookState` runs one of torch's hooks and counts the bytes torch's algorithm
sends, so the training loop reads it like poise's own state
(:class:`~poise.comm.state.CommState`). :func:`fp16` and :func:`powersgd` build the pair
``(hook, state)``; ``builder.py`` lists them in its registry beside poise's codecs.

(This module must not use ``from __future__ import annotations``: DDP inspects the hook's
annotations at registration and compares them with real classes, not strings.)
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from poise.comm.probe import CommHook
from poise.comm.state import CountingState
from poise.comm.topology import Topology
from poise.config import CommConfig


class TorchHookState(CountingState):
    """Runs one of torch's hooks and counts its bytes; a :class:`~poise.comm.state.CommState`.

    Wire bytes are what torch's algorithm sends (fp16: half; PowerSGD: the factors of each
    compressed matrix plus the uncompressed tensors, by PowerSGD's own size rule). Encode and
    decode seconds are not visible from outside torch's hook and stay 0, and so do the
    inter-node counters (torch's hooks run flat). torch's hooks only average, so ``weight``
    must stay None. Nothing is checkpointed: torch's state holds no residual poise restores.
    """

    def __init__(self, torch_hook: CommHook, torch_state: Any,
                 wire_bytes: Callable[[Any, dist.GradBucket], int]) -> None:
        super().__init__()
        self.torch_hook = torch_hook
        self.torch_state = torch_state
        self.wire_bytes = wire_bytes

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def shared_state_dict(self) -> dict[str, Any]:
        return {}  # torch's own hook state (PowerSGD's iteration) restarts on every rank alike

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        pass


def torch_hook_adapter(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: count the bucket, then run torch's hook on it.

    Raises:
        ValueError: ``state.weight`` is set (torch's hooks only average).
    """
    if state.weight is not None:
        raise ValueError("torch's comm hooks only average: weighted reduction needs a poise codec")
    if state.bypassing:
        # torch-fp16's state is the process group (None: the default one), PowerSGD's holds it
        return default_hooks.allreduce_hook(getattr(state.torch_state, "process_group", state.torch_state), bucket)
    buffer = bucket.buffer()
    state.counters.add(raw_bytes=buffer.numel() * buffer.element_size(),
                       wire_bytes=state.wire_bytes(state.torch_state, bucket), buckets=1)
    return state.torch_hook(state.torch_state, bucket)


def _fp16_wire_bytes(_: Any, bucket: dist.GradBucket) -> int:
    return bucket.buffer().numel() * 2


def _powersgd_wire_bytes(ps: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> int:
    """Bytes torch's ``powerSGD_hook`` sends for ``bucket`` (read before it runs)."""
    buffer = bucket.buffer()
    if ps.iter < ps.start_powerSGD_iter:
        return buffer.numel() * buffer.element_size()
    total = 0
    for grad in bucket.gradients():
        rows = grad.shape[0] if grad.dim() > 1 else 0
        cols = grad.numel() // rows if rows else 0
        rank = min(rows, cols, ps.matrix_approximation_rank)
        # torch compresses a matrix only when that at least divides its size by min_compression_rate
        if rows and (rows + cols) * rank * ps.min_compression_rate < rows * cols:
            total += (rows + cols) * rank * grad.element_size()
        else:
            total += grad.numel() * grad.element_size()
    return total


def fp16(config: CommConfig, group: dist.ProcessGroup | None, topology: Topology | None,
         start_step: int) -> tuple[CommHook, TorchHookState]:
    """torch's ``fp16_compress_hook`` (it compresses from the first step: ``start_step`` unused)."""
    return torch_hook_adapter, TorchHookState(default_hooks.fp16_compress_hook, group, _fp16_wire_bytes)


def powersgd(config: CommConfig, group: dist.ProcessGroup | None, topology: Topology | None,
             start_step: int) -> tuple[CommHook, TorchHookState]:
    """torch's ``powerSGD_hook`` with ``config.powersgd_rank``, warm start, and error feedback
    if ``config.error_feedback``, compressing from ``max(2, start_step)``. On gloo it needs a
    single bucket (``builder.requires_single_bucket``)."""
    # torch requires start_powerSGD_iter > 1 with error feedback or warm start (bucket rebuild)
    start = max(2, start_step)
    ps = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=config.powersgd_rank,
                                     start_powerSGD_iter=start, use_error_feedback=config.error_feedback,
                                     warm_start=True, random_seed=0)
    return torch_hook_adapter, TorchHookState(powerSGD_hook.powerSGD_hook, ps, _powersgd_wire_bytes)
