"""Whether a module is FSDP2's (``fully_shard``) or a tensor a ``DTensor``, without importing FSDP.

Why not ``isinstance(model, FSDPModule)`` with a module-level import: ``torch.distributed.fsdp``
and ``torch.distributed.tensor`` take about 1 s to import on 2 cores (sympy, ``torch.export``,
DTensor's operator table), in every worker and in the ``poise`` command, and a DDP job never
needs them. A module can only be FSDP2's, and a tensor only a DTensor, once those packages are
imported (``fully_shard`` and ``DTensor`` are defined there), so these checks read the classes
from ``sys.modules`` and answer False while the packages are not loaded. The code that runs
FSDP2 (``poise.sync.sharded``, ``poise.checkpoint.sharded``, ``poise.train.shard``) is imported
only when a model is sharded.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor


def is_fsdp_module(obj: object) -> TypeGuard[FSDPModule]:
    """Whether ``obj`` was sharded with ``fully_shard`` (an ``FSDPModule``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(obj, fsdp.FSDPModule)


def is_dtensor(obj: object) -> TypeGuard[DTensor]:
    """Whether ``obj`` is a ``DTensor`` (a sharded parameter, its gradient or a norm over shards)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(obj, tensor.DTensor)


__all__ = ["is_dtensor", "is_fsdp_module"]
