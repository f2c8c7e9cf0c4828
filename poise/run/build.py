"""Assemble a session's parts from its settings: :func:`build`, run once per rank.

The plan first, then the objects: the data plan (this rank's sampler, the re-planner), the
clock, the emulation (the only place outside ``poise/emulate/`` that imports it), the
synchronization strategy with the emulation's hook wrapper around it (for a model sharded
with ``fully_shard``, :class:`~poise.sync.Sharded`, stretched before each module's reduction),
the recorder, the live metrics. :class:`poise.Session` keeps what this returns and only ever
calls it once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from poise.balance import BalancedBatchSampler
from poise.balance.packed_sampler import PackedBatchSampler
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.replay import ReplayedPartitioner, load_replans
from poise.comm import registry
from poise.comm.topology import default_group_timeout, spans_nodes
from poise.config import (
    BalanceConfig,
    CommConfig,
    DiagnosticsConfig,
    EmulateConfig,
    MetricsConfig,
    StragglerConfig,
    SyncConfig,
)
from poise.decide import default_codec, replan_schedule
from poise.diagnostics import metrics as metrics_mod
from poise.diagnostics.metrics import MetricsExporter
from poise.diagnostics.timeline import Timeline
from poise.emulate import Emulation, emulation_for
from poise.run.data import Data, Sampler, plan_sampler
from poise.run.record import Recorder
from poise.runtime import memory
from poise.runtime.clock import Clock, clock_for
from poise.runtime.fsdp import is_fsdp_module
from poise.sync import AllReduce, Deadline, Outer, Sync, TorchftDiLoCo, TorchLocalSGD

if TYPE_CHECKING:
    from poise.sync.sharded import Sharded


@dataclass
class Parts:
    """Everything a session is made of (see :func:`build`)."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    collective_device: torch.device
    sampler: Sampler
    loss_terms: np.ndarray | None
    partitioner: DynamicPartitioner | ReplayedPartitioner | None
    clock: Clock
    sync: Sync
    emulation: Emulation
    recorder: Recorder
    metrics: MetricsExporter | None
    freed_memory: memory.FreedMemory | None
    compression_start: int
    comm: CommConfig  # the codec named, or decided by poise when none was (codec_why says why)
    codec_why: str | None


def build(model: nn.Module, data: Data, *, balance: BalanceConfig, comm: CommConfig, straggler: StragglerConfig,
          sync_config: SyncConfig, emulate: EmulateConfig, diagnostics: DiagnosticsConfig,
          metrics: MetricsConfig | None, keep_freed_memory: bool | None) -> Parts:
    """The parts of one rank's session (every rank calls it alike: it makes process groups).

    Raises:
        ValueError: one line, for settings that disagree with the process group, the data or
            each other.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("poise.Session needs torch.distributed initialised first: call "
                         "dist.init_process_group(...) (torchrun sets the environment it reads)")
    rank, world_size, backend = dist.get_rank(), dist.get_world_size(), str(dist.get_backend())
    deadline = straggler.enabled or bool(emulate.delay)
    codec_why = None
    if comm.codec is None:  # no codec named: poise decides (poise/decide/policy.py)
        codec, codec_why = default_codec(
            spans_nodes=spans_nodes(range(world_size)), sharded=is_fsdp_module(model), sync_mode=sync_config.mode,
            deadline=deadline, accum_steps=data.accum_steps,
            run_length_known=data.total_steps is not None or comm.start_step is not None)
        comm = dataclasses.replace(comm, codec=codec)
    registry.check(comm)
    if registry.codec(comm.codec).lossy and comm.start_step is None and data.total_steps is None:
        raise ValueError(f"comm.codec={comm.codec!r} is lossy: it starts compressing after a twentieth of the run and "
                         "twice the learning-rate warm-up, so give Data(total_steps=...) (optimizer steps; and "
                         "lr_warmup_steps=...), or CommConfig(start_step=N) to say when yourself")
    if is_fsdp_module(model):
        _check_sharded(sync_config, straggler, emulate)
    _check_model(model)
    if sync_config.outer and (deadline or comm.local_first):
        raise ValueError(f"sync.mode={sync_config.mode!r} meets the other ranks every few steps, not at every step's "
                         f"deadline: it needs straggler='off' (not {straggler.mode!r}), no emulated delays and no "
                         "comm.local_first")
    sync_config.check_codec(comm.codec)
    if deadline and data.accum_steps != 1:
        raise ValueError(f"accum_steps={data.accum_steps} with straggler.mode={straggler.mode!r} (or delays): "
                         "a deadline step accumulates its own micro-batches (straggler.micro_batches); "
                         "use accum_steps=1")
    sampler = plan_sampler(data, balance, rank, world_size)
    loss_terms = sampler.piece_terms() if isinstance(sampler, PackedBatchSampler) else data.terms()
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    keep = device.type == "cpu" if keep_freed_memory is None else keep_freed_memory
    freed_memory = memory.keep_freed_memory() if keep else None
    collective_device = device if backend == "nccl" else torch.device("cpu")
    partitioner: DynamicPartitioner | ReplayedPartitioner | None = None
    if balance.strategy in ("auto", "dynamic") and balance.replay and isinstance(sampler, BalancedBatchSampler):
        partitioner = ReplayedPartitioner(sampler, load_replans(balance.replay, world_size))
    elif balance.strategy == "dynamic" or (balance.strategy == "auto" and isinstance(sampler, BalancedBatchSampler)):
        assert isinstance(sampler, BalancedBatchSampler)  # auto with a sampler of the user's own: no re-plans
        # the windows are host-side numbers: under NCCL they are gathered over a gloo group of the
        # same ranks, so a re-plan (after every step, under auto) never synchronizes the GPU stream
        side = dist.new_group(backend="gloo", timeout=default_group_timeout()) if backend == "nccl" else None
        partitioner = DynamicPartitioner(
            sampler, window_steps=balance.window_steps, max_share_change=balance.max_share_change,
            confident_error=balance.confident_error, fit_alpha=balance.fit_alpha,
            device=torch.device("cpu") if side is not None else collective_device, group=side,
            **replan_schedule(balance),
        )
    emulation = emulation_for(emulate, rank=rank, threads=torch.get_num_threads(), seed=data.seed)
    clock = clock_for(device)
    start = registry.compression_start(comm, data.total_steps or 0, data.lr_warmup_steps)
    common: dict[str, Any] = {"clock": clock, "backend": backend, "compression_start": start,
                              "outer": [emulation.slowdown.wrap_hook]}
    sync: AllReduce | Deadline | Outer | Sharded | TorchLocalSGD | TorchftDiLoCo
    baselines = {"torch-localsgd": TorchLocalSGD, "torchft-diloco": TorchftDiLoCo}  # other libraries', to compare
    if is_fsdp_module(model):
        from poise.sync.sharded import Sharded  # FSDP2's code: imported for a sharded model only (runtime/fsdp.py)

        emulation.slowdown.by_cpu = True  # its forward and backward wait in collectives: stretch compute only
        sync = Sharded(model, comm, clock=clock, backend=backend, compression_start=start,
                       before_reduce=[emulation.slowdown.stretch] if emulation.slowdown.sleeps else [])
    elif sync_config.mode in baselines:
        sync = baselines[sync_config.mode](model, comm, sync_config, **common)
    elif sync_config.outer:
        sync = Outer(model, comm, sync_config, world_size=world_size, last_step=data.total_steps, **common)
    elif deadline:
        cost = getattr(sampler, "cost_fn", None)
        costs = np.asarray(cost(sampler.lengths) if cost is not None else sampler.lengths, dtype=np.float64)
        sync = Deadline(model, comm, straggler, rank=rank, world_size=world_size, costs=costs, loss_terms=loss_terms,
                        device=collective_device, seed=data.seed, pauses=emulation.delays, **common)
    else:
        sync = AllReduce(model, comm, **common)
    emulation.install(sync.model)
    exporter = metrics_mod.start(metrics, world_size) if metrics is not None and rank == 0 else None
    publish = None
    if exporter is not None:
        def publish(block: np.ndarray) -> None:  # rank 0, after each gather: the new block to the endpoint
            exporter.observe(block, replans=len(partitioner.history) if partitioner else 0)
    timeline = Timeline(rank, world_size, diagnostics.gather_every_steps, collective_device, on_gather=publish)
    last_step = data.total_steps * data.accum_steps if data.total_steps is not None else None
    recorder = Recorder(clock=clock, timeline=timeline, lengths=sampler.lengths, sync=sync, partitioner=partitioner,
                        trial=sync.trial,
                        freed_memory=freed_memory, last_step=last_step)
    return Parts(rank=rank, world_size=world_size, backend=backend, device=device,
                 collective_device=collective_device, sampler=sampler,
                 loss_terms=loss_terms, partitioner=partitioner, clock=clock, sync=sync, emulation=emulation,
                 recorder=recorder, metrics=exporter, freed_memory=freed_memory, compression_start=start,
                 comm=comm, codec_why=codec_why)


def _check_model(model: nn.Module) -> None:
    """Refuse, in one line, a model a session cannot take as it is: one whose blocks are sharded
    with ``fully_shard`` but not its root (its forward would mix plain tensors and DTensors:
    torch's ``aten.cat ... mixed torch.Tensor and DTensor``), and a DDP model that already has
    a communication hook (a second ``attach``/``Session`` on it: torch's ``register_comm_hook
    can only be called once``)."""
    if not is_fsdp_module(model):
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        sharded = [name for name, m in inner.named_modules() if is_fsdp_module(m)]
        if sharded:
            raise ValueError(f"the model's submodule(s) {', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''} "
                             "are sharded with fully_shard but the model itself is not: call fully_shard(model) on "
                             "the root too, after its blocks, and pass that")
    if isinstance(model, DistributedDataParallel) and getattr(model, "_comm_hooks", None):
        raise ValueError("this DDP model already has a communication hook (a poise session was made on it before, or "
                         "you registered one): make one session per model and reuse it (session.model), or pass a "
                         "DDP model without a hook")


def _check_sharded(sync_config: SyncConfig, straggler: StragglerConfig, emulate: EmulateConfig) -> None:
    """Refuse, in one line each, what cannot run on a ``fully_shard`` model (the codec's own
    limits are :class:`~poise.sync.Sharded`'s to say)."""
    if straggler.enabled or emulate.delay:
        raise ValueError(f"straggler.mode={straggler.mode!r} (or emulated delays) with fully_shard: FSDP2 gathers "
                         "and reduces layer by layer inside forward and backward, so no rank can stop at a "
                         "deadline; use straggler='off' (balancing still plans each rank's share)")
    if sync_config.mode != "step":
        raise ValueError(f"sync.mode={sync_config.mode!r} with fully_shard: local SGD and DiLoCo keep a whole model "
                         "on every rank, which a sharded model does not have; use sync='step'")


__all__ = ["Parts", "build"]
