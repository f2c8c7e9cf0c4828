"""The full (unsharded) state of a model sharded with FSDP2 (``fully_shard``), in and out.

Under FSDP2 each rank holds one shard of every parameter and of its optimizer state (DTensors),
so ``model.state_dict()`` on rank 0 is rank 0's shards only. A checkpoint of a sharded model
holds the *full* tensors instead, gathered with torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``: ``full_state_dict=True, cpu_offload=True``, so only
rank 0 holds them, on the CPU), under the same names and files as a DDP checkpoint's: the
optimizer's state keyed by parameter index as ``optimizer.state_dict()`` keys it. So the
manifest, ``poise checkpoint verify``/``list`` and differential saves need nothing new, and a
checkpoint restores on any number of ranks: every rank reads the full tensors and keeps its
own shard of each (``set_model_state_dict`` / ``set_optimizer_state_dict`` with the full state
on every rank), on the same world size exactly as saved.

Gathering and distributing are collectives (all-gathers; scatters from rank 0): every rank
calls :func:`full_state` and :func:`load_full_state`, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from poise.runtime.fsdp import is_fsdp_module


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded with FSDP2 (its root went through ``fully_shard``)."""
    return is_fsdp_module(model)


def reshard(model: nn.Module) -> None:
    """Register every FSDP unit's sharded parameters again. After a forward without a backward
    (an evaluation) the root unit keeps its gathered parameters registered, and the names of
    those are not the optimizer's parameters; resharding frees them (FSDP2 gathers them again
    in the next forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its order (index ``i`` of
    ``optimizer.state_dict()`` is ``names[i]``).

    Raises:
        ValueError: the optimizer holds a parameter that is not the model's.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(flat) if id(p) not in names]
    if missing:
        raise ValueError(f"the optimizer's parameter {missing[0]} is not one of the model's")
    return [names[id(p)] for p in flat]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor],
                                                                           dict[int, dict[str, Any]]]:
    """Rank 0: the full model state (name -> CPU tensor) and the full optimizer state per
    parameter index; other ranks: two empty tables. A collective: every rank calls it."""
    reshard(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    index = {name: i for i, name in enumerate(param_names(model, optimizer))}
    per_param = {index[name]: dict(entries) for name, entries in optim_state.get("state", {}).items()}
    return dict(model_state), per_param


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                    per_param: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Put a full state (what :func:`full_state` gave rank 0, read by every rank) into the
    sharded model and optimizer: each rank keeps its shard of every tensor. ``groups`` are the
    optimizer's parameter groups as ``optimizer.state_dict()`` gives them (parameters by index).
    A collective: every rank calls it with the same state."""
    reshard(model)
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, dict(model_state), options=options)
    names = param_names(model, optimizer)
    by_name = {
        "state": {names[i]: entries for i, entries in sorted(per_param.items())},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in groups],
    }
    # torch fills an empty optimizer state with one zero-learning-rate step first, which it
    # skips when a gradient is there (and then finds no shards to fill): none may be
    optimizer.zero_grad(set_to_none=True)
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
