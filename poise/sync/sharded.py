"""FSDP2 and HSDP: :class:`Sharded`, the strategy for a model the user sharded with ``fully_shard``.

How it works. The user shards their model (each block, then the root) and hands it to
``poise.Session``; the session sees an ``FSDPModule`` and builds this strategy instead of
:class:`~poise.sync.AllReduce`. It reads the mesh from the parameters (DTensors) and picks one
of three layouts:

- **FSDP**: a 1-D mesh over every rank. The codec runs on the reduce-scatter
  (:class:`poise.comm.sharded.ShardedReduceScatter`: casts, int8, top-k, sign, random-k).
- **native HSDP**: a 2-D ``(replicate, shard)`` mesh. FSDP2 reduce-scatters in the shard group
  and all-reduces over the replicate group itself; only casts (``fp16``, ``bf16``) run, on
  the reduce-scatter.
- **HSDP with poise's codec between nodes**: a 1-D mesh of the *shard* groups only
  (``fully_shard(block, mesh=mesh["shard"])``), smaller than the world. FSDP2 reduce-scatters
  inside each shard group, and poise all-reduces each shard over the replicate group (the
  ranks at the same position of every shard group) as FSDP2's all-reduce hook, with any
  poise codec, PowerSGD included, and error feedback per module's shard
  (:class:`poise.comm.sharded.ReplicateAllReduce`). Shard groups must be contiguous blocks of
  ranks (``0..S-1``, ``S..2S-1``, ...), as ``init_device_mesh(..., (R, S))`` makes them.

Exact gradients with unequal batches: the step multiplies each rank's loss by
``world × its share of the step's loss terms``, which needs the reduction to be the mean over
all data-parallel ranks. Every module sums (``set_force_sum_reduction_for_comms``: gloo's AVG
would sum anyway) and divides once by the world size (``set_gradient_divide_factor``; with
poise's replicate all-reduce, which averages over the replicate group, by the shard size).
``micro_batch(last)`` is ``set_requires_gradient_sync(last)``: accumulating micro-batches
neither reduce-scatter nor all-reduce.

What does not apply (refused in one line where the session is built): deadline steps (FSDP2's
collectives run per layer inside forward and backward, so no rank can stop at a deadline),
outer synchronization (local SGD, DiLoCo keep a whole model per rank), ``comm.local_first``,
collectives other than ``flat``, ``comm.codec=auto`` and torch's own DDP hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from poise.comm import builder as comm_builder
from poise.comm import registry
from poise.comm.adapter import HookState
from poise.comm.sharded import (
    BlockingProbe,
    CountingAllGather,
    NativeReplicateCounter,
    ReplicateAllReduce,
    ShardedComm,
    ShardedReduceScatter,
    check_shard_codec,
    node_identity,
    plus,
)
from poise.comm.state import StepStats
from poise.comm.topology import default_group_timeout
from poise.config import CommConfig
from poise.runtime.clock import Clock
from poise.sync.base import LossScope

log = logging.getLogger(__name__)

_CASTS = ("none", "fp16", "bf16")


class Sharded:
    """FSDP2 / HSDP synchronization of a ``fully_shard`` model (see module doc); a
    :class:`~poise.sync.Sync`.

    Args:
        model: the root ``FSDPModule`` (every parameter sharded by ``fully_shard``).
        config: the codec and error feedback (``comm.collective`` must be ``flat``).
        clock: what the probe's marks are.
        backend: the process group's backend.
        compression_start: optimizer steps reduced uncompressed first.
        before_reduce: called before each module's gradient reduction (emulation's stretch).

    Attributes:
        mode: ``fsdp`` or ``hsdp``; ``native``: HSDP on a 2-D mesh (FSDP2's own all-reduce).
        shard_size, replicate_size: ranks per shard group, and shard groups.

    Raises:
        ValueError: one line, for a model that is not sharded as above, or a codec the layout
            cannot run (naming what can).
    """

    loss_scope = LossScope()  # every rank: DDP's (FSDP2's) mean over the world
    replicas_agree = True  # the shards make one model, which every rank's optimizer step keeps alike
    trial = None  # comm.codec=auto is refused here

    def __init__(self, model: nn.Module, config: CommConfig, *, clock: Clock, backend: str, compression_start: int,
                 before_reduce: Sequence[Callable[[], None]] = ()) -> None:
        if not isinstance(model, FSDPModule):
            raise ValueError(f"poise.sync.Sharded takes a model sharded with fully_shard (got {type(model).__name__})")
        _check_config(config)
        comm_builder.check_backend(config, backend)
        self.config, self.model = config, model
        self.probe = BlockingProbe(clock)
        mesh, placements = _mesh_of(model)
        world, rank = dist.get_world_size(), dist.get_rank()
        shard_group = mesh.get_group(mesh.ndim - 1)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (node_identity(), dist.get_process_group_ranks(shard_group)))
        self.native = mesh.ndim == 2
        self.shard_size = shard_group.size()
        self.replicate_size = world // self.shard_size
        replicate_group: dist.ProcessGroup | None = None
        if self.native:
            if not isinstance(placements[0], Replicate):
                raise ValueError(f"a 2-D mesh must be (replicate, shard) with placements (Replicate(), Shard(0)), "
                                 f"not {placements}: that is what fully_shard makes for HSDP")
            if config.codec not in _CASTS:
                raise ValueError(f"comm.codec={config.codec!r} on native HSDP (a 2-D mesh): only fp16 and bf16 run on "
                                 "its reduce-scatter; for a codec between nodes, fully_shard on mesh['shard'] alone "
                                 "and poise runs the replicate all-reduce with it")
            replicate_group = mesh.get_group(0)
        elif self.shard_size < world:
            replicate_group = _replicate_group(everyone, rank, world, self.shard_size)
        self.mode = "hsdp" if replicate_group is not None else "fsdp"
        self._hook_mode = replicate_group is not None and not self.native
        if not self._hook_mode:
            check_shard_codec(registry.codec(config.codec).codec)
        self.comm = ShardedComm(self.probe, start_step=compression_start, node_of=[n for n, _ in everyone],
                                before_reduce=before_reduce)
        _, state = comm_builder.build(config, replicate_group if self._hook_mode else None,
                                      start_step=compression_start)
        assert isinstance(state, HookState), state  # torch's own hooks are refused above
        self._hook_state = state
        self._install(model, replicate_group)
        self._optimizer_check: Any = None  # armed across the session's first step
        self._optimizer_checked = False
        log.info("sharded: %s%s, shard groups of %d, %d replicas, codec %r on the %s", self.mode,
                 " (native)" if self.native else "", self.shard_size, self.replicate_size, config.codec,
                 "replicate all-reduce" if self._hook_mode else "reduce-scatter")

    def _install(self, model: nn.Module, replicate_group: dist.ProcessGroup | None) -> None:
        """Sum, divide once, and poise's collectives, on every sharded module."""
        world = dist.get_world_size()
        divide = self.shard_size if self._hook_mode else world
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            key = name or "root"
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(divide))
            reduce_scatter = ShardedReduceScatter(self.comm, None if self._hook_mode else self.codec, key)
            module.set_custom_reduce_scatter(reduce_scatter)
            module.set_custom_all_gather(CountingAllGather(self.comm))
            if self.native:
                assert replicate_group is not None
                module.set_all_reduce_hook(NativeReplicateCounter(self.comm, replicate_group, reduce_scatter))
            elif self._hook_mode:
                assert replicate_group is not None
                state = self._hook_state
                module.set_all_reduce_hook(ReplicateAllReduce(
                    self.comm, state.reducer, state.uncompressed, state.counters, replicate_group, key,
                    _shard_shapes(module, self.shard_size), first=self.shard_size == 1))

    @property
    def codec(self) -> Any:
        """The codec (with error feedback, if on): on the reduce-scatter, or between nodes on HSDP."""
        return self._hook_state.codec

    # -- the call points -------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        if not self._optimizer_checked:  # the session's first step: watch the optimizers stepped in it
            self._optimizer_checked = True
            self._optimizer_check = register_optimizer_step_pre_hook(_StaleOptimizerCheck(self.model))
        self.comm.reset_step()
        self._hook_state.reset_step()

    def micro_batch(self, last: bool) -> None:
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]

    def backward(self, run: Callable[[], None]) -> None:
        mark = self.probe.clock.mark()
        self.comm.expected = True
        try:
            run()
        finally:
            self.comm.expected = False
        self.probe.close_backward(mark)

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        """Count the optimizer step (compression starts after ``compression_start`` of them)."""
        if self._optimizer_check is not None:  # the user's optimizer step is inside the step: done
            self._optimizer_check.remove()
            self._optimizer_check = None
        if optimizer_step:
            self.comm.step += 1

    def between_steps(self) -> bool:
        return False

    def conclude(self) -> bool:
        """Nothing: the shards make one model, reduced at every step."""
        return True

    def traffic(self) -> tuple[StepStats, StepStats]:
        """All of this rank's bytes (parameter all-gathers, reduce-scatters, replicate
        all-reduces) and those over groups spanning nodes."""
        return plus(self.comm.step_stats(), self._hook_state.step_stats()), self.comm.inter_node_stats()

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """Nothing: FSDP2 has no buckets to settle (residuals are keyed by module name)."""

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The step count and this rank's error-feedback residuals (per module and chunk, or
        per module's shard), warm starts."""
        return {"step": self.comm.step, "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.comm.step = int(state["step"])
        self.codec.load_state_dict(state["codec"])

    def shared_state_dict(self) -> dict[str, Any]:
        return {"step": self.comm.step}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.comm.step = int(state["step"])

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "native": self.native, "codec": self.config.codec,
                "codec_on": "replicate all-reduce" if self._hook_mode else "reduce-scatter",
                "shard_size": self.shard_size, "replicate_size": self.replicate_size}


class _StaleOptimizerCheck:
    """A pre-hook on every optimizer's step during a session's first step: an optimizer built
    *before* ``fully_shard`` holds the replaced plain tensors, which never get a gradient, so
    its steps would silently train nothing. Refused in one line instead (an unrelated
    optimizer whose parameters have gradients, a GAN's other one, passes)."""

    def __init__(self, model: nn.Module) -> None:
        self.ids = {id(p) for p in model.parameters()}

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stale = all(id(p) not in self.ids and p.grad is None and not isinstance(p, DTensor) for p in params)
        if params and stale:
            raise ValueError(f"{type(optimizer).__name__} holds none of the sharded model's parameters: build it "
                             "after fully_shard (which replaces every parameter with a sharded DTensor), from "
                             "model.parameters()")


def _check_config(config: CommConfig) -> None:
    """Refuse, in one line, what the sharded collectives do not run."""
    info = registry.codec(config.codec)
    if info.codec is None or config.codec == "auto":
        raise ValueError(f"comm.codec={config.codec!r} is for DDP (a comm hook, or a dry run over DDP's buckets): "
                         "with fully_shard use none, fp16, bf16, int8, topk, sign, randomk or (on HSDP) powersgd")
    if config.collective != "flat":
        raise ValueError(f"comm.collective={config.collective!r} with fully_shard: FSDP2 runs its own collectives; "
                         "use comm.collective=flat (for compression between nodes, HSDP with a codec)")
    if config.local_first:
        raise ValueError("comm.local_first with fully_shard: a rank holds only its own shard of the gradient; "
                         "turn local_first off")


def _mesh_of(model: nn.Module) -> tuple[Any, tuple[Any, ...]]:
    """The one device mesh and placements of every parameter.

    Raises:
        ValueError: a parameter fully_shard did not shard, or several meshes.
    """
    mesh, placements = None, None
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise ValueError(f"parameter {name!r} is not sharded by fully_shard: poise would not synchronize its "
                             "gradient (shard every parameter: fully_shard each block, then the root)")
        if mesh is None:
            mesh, placements = p.device_mesh, tuple(p.placements)
        elif p.device_mesh != mesh:
            raise ValueError(f"parameter {name!r} is on another device mesh than the first: shard every module on "
                             "one mesh")
    if mesh is None or placements is None:
        raise ValueError("the sharded model has no parameters")
    if mesh.ndim > 2 or not isinstance(placements[-1], Shard):
        raise ValueError(f"a mesh of {mesh.ndim} dimensions with placements {placements}: poise takes FSDP2 on a "
                         "1-D mesh or HSDP on a 2-D (replicate, shard) mesh")
    return mesh, placements


def _replicate_group(everyone: list[Any], rank: int, world: int, shard_size: int) -> dist.ProcessGroup:
    """The replicate group of a model sharded on shard sub-groups: the ranks at this rank's
    position in every shard group. Every rank creates every such group, in the same order.

    Raises:
        ValueError: shard groups that are not contiguous, equal blocks of ranks.
    """
    for r, (_, ranks) in enumerate(everyone):
        first = r // shard_size * shard_size
        if world % shard_size or list(ranks) != list(range(first, first + shard_size)):
            raise ValueError(f"rank {r}'s shard group is ranks {list(ranks)}: HSDP with poise's codec needs "
                             f"contiguous shard groups of {shard_size} (0..{shard_size - 1}, ...), as "
                             "init_device_mesh(device, (replicas, shard)) makes them")
    mine = None
    for position in range(shard_size):
        ranks = list(range(position, world, shard_size))
        group = dist.new_group(ranks, timeout=default_group_timeout())
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


def _shard_shapes(module: nn.Module, shard_size: int) -> list[tuple[int, ...]] | None:
    """Shapes of ``module``'s gradient shards in FSDP2's flat order (its own parameters, not
    those of nested sharded modules; post-order, as ``fully_shard`` collects them), dim 0
    padded to a multiple of ``shard_size``; None where that order is not known for sure."""
    shapes: list[tuple[int, ...]] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, root: bool) -> bool:
        if not root and isinstance(mod, FSDPModule):
            return True
        for child in mod.children():
            if not visit(child, False):
                return False
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() == 0 or not isinstance(p, DTensor) or p.placements[-1] != Shard(0):
                return False
            shapes.append((-(-p.shape[0] // shard_size), *p.shape[1:]))
        return True

    return shapes if visit(module, True) else None


__all__ = ["Sharded"]
