"""What ``poise train --parallel fsdp|hsdp`` does to the task's model before :class:`poise.Session`:
``fully_shard`` (FSDP2) on each repeated block, then on the root, over a device mesh.

Why blocks and then the root: FSDP2 gathers one unit's parameters at a time, so a unit per
block keeps only one block whole in memory during the forward and backward and lets the
next block's all-gather overlap this one's compute; the root unit takes what is left (the
embeddings, the head). Which modules are blocks is :func:`shard_units`, a pure function of the
model's structure: the children of its largest ``nn.ModuleList`` (a transformer's layers), or,
for a model without one, its top-level children that hold parameters.

The mesh (:func:`mesh_layout`): ``fsdp`` shards over every rank (a 1-D mesh); ``hsdp`` shards
inside groups of ``parallel.shard_size`` consecutive ranks (by default one machine's) and
replicates across them (a 2-D ``replicate x shard`` mesh, FSDP2's own HSDP). With a codec
FSDP2 cannot run on its own replicate all-reduce (anything but ``none``, ``fp16`` and ``bf16``),
the model is sharded on the ``shard`` dimension only, and poise's strategy
(``poise.sync.Sharded``) runs the replicate all-reduce with the codec itself (see its module doc).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from poise.comm import registry
from poise.config import CommConfig, ParallelConfig

# codecs FSDP2's own HSDP carries: none, and the casts its reduce-scatter runs in a low dtype
NATIVE_HSDP_CODECS = ("none", "fp16", "bf16")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def shard_units(model: nn.Module) -> list[str]:
    """Names of the submodules to ``fully_shard`` before the root, in the model's order.

    The children (holding parameters) of the ``nn.ModuleList`` with the most parameters, the
    shallowest on a tie; without a ``ModuleList`` holding parameters, the root's children that
    hold parameters. The units are siblings, so no parameter belongs to two of them; what they
    leave belongs to the root's unit. A model with one unit's worth of children still gets
    them (a unit per child costs an all-gather each, nothing more).
    """
    lists = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and _numel(module) > 0]
    if lists:
        name, blocks = max(lists, key=lambda item: (_numel(item[1]), -item[0].count(".")))
        prefix = f"{name}." if name else ""
        return [f"{prefix}{child}" for child, module in blocks.named_children() if _numel(module) > 0]
    return [name for name, module in model.named_children() if _numel(module) > 0]


@dataclass(frozen=True)
class MeshLayout:
    """The device mesh a mode asks for.

    Attributes:
        shape: ranks per mesh dimension (their product is the world size).
        names: the dimensions' names (``shard``; or ``replicate``, ``shard``).
        shard_only: shard on the ``shard`` dimension alone (HSDP whose replicate all-reduce
            runs poise's codec, not FSDP2's).
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]
    shard_only: bool = False


def mesh_layout(parallel: ParallelConfig, codec: str | None, world_size: int, nproc: int) -> MeshLayout:
    """The mesh of ``parallel.mode`` (fsdp or hsdp) for ``world_size`` ranks, ``nproc`` per machine.

    Raises:
        ValueError: a mode that is not sharded, or hsdp's shard size does not divide the world.
    """
    if parallel.mode == "fsdp":
        return MeshLayout((world_size,), ("shard",))
    if parallel.mode != "hsdp":
        raise ValueError(f"parallel.mode={parallel.mode!r} does not shard the model: allowed here are fsdp, hsdp")
    shard = parallel.shard_group(nproc)
    if shard > world_size or world_size % shard:
        raise ValueError(f"parallel.shard_size={shard} does not divide the job's {world_size} ranks: hsdp needs "
                         "equal shard groups (give a divisor, or leave it unset for one group per machine)")
    return MeshLayout((world_size // shard, shard), ("replicate", "shard"),
                      shard_only=registry.codec(codec).name not in NATIVE_HSDP_CODECS)


def shard_model(model: nn.Module, parallel: ParallelConfig, comm: CommConfig, *, world_size: int, nproc: int,
                device: torch.device) -> nn.Module:
    """``model`` (already on ``device``) sharded in place: each of :func:`shard_units` and then
    the root get ``fully_shard`` on :func:`mesh_layout`'s mesh; returns the root, now an
    :class:`~torch.distributed.fsdp.FSDPModule`. A collective: every rank calls it with the same
    model. Its parameter names stay those of the unsharded model (so do checkpoints')."""
    layout = mesh_layout(parallel, comm.codec, world_size, nproc)
    mesh: DeviceMesh = init_device_mesh(device.type, layout.shape, mesh_dim_names=layout.names)
    if layout.shard_only:
        mesh = mesh["shard"]
    for name in shard_units(model):
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)
    return model

