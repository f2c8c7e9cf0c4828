"""Data parallelism over pipeline replicas (``poise pipeline --dp N``): the ``dp`` x ``pp``
process groups, each replica's share of a step's batch and its exact loss weight, and DDP of
a stage over its replicas with poise's comm hook.

Layout: ranks form a ``(dp, pp)`` grid of N replicas x P stages, rank = d·P + p (the order of
a DeviceMesh with dims ``("dp", "pp")``). A pipeline (``pp`` group) is P consecutive ranks, so
with P or a multiple of P workers per node its activations never leave the node; a stage's
replicas (``dp`` group) are the ranks P apart, so on several nodes the DDP all-reduce is the
traffic between nodes: where a codec (``comm.codec``) pays.

Every replica runs the same stage plan (planned once, from rank 0's profile) on its share of
each step's batch: ``train.batch_size`` is per data-parallel rank, as in ``poise train``, so a
step is N x ``train.batch_size`` samples, split by :func:`replica_shares`. The step is exact:
replica d scales its loss (the mean over its own real target tokens) by ``N · n_d / Σ n``
(:func:`poise.balance.loss_weight`), so DDP's average over the N replicas is the gradient of
the whole step's mean loss, as one process computes it on the whole batch, however unequal
the shares are.

torch's pipelining supports a ``DistributedDataParallel`` stage module for GPipe and 1F1B: it
keeps the micro-batches' backwards under ``no_sync`` and arms DDP's reducer for the last one,
whose backward then reduces every bucket through the registered hook
(``torch/distributed/pipelining/stage.py``, ``backward_maybe_with_nosync``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from poise.balance.costs import linear_cost
from poise.balance.sharding import split_step
from poise.balance.weights import loss_weight
from poise.comm import builder as comm_builder
from poise.comm.probe import BucketProbe, instrumented
from poise.comm.topology import default_group_timeout
from poise.config import CommConfig
from poise.runtime.clock import clock_for
from poise.tasks.base import IGNORE_INDEX


@dataclass(frozen=True)
class ReplicaGrid:
    """Where this rank sits in the ``(dp, pp)`` grid and the groups it talks on.

    Attributes:
        dp_size: replicas of the pipeline (N).
        pp_size: stages of each pipeline (P).
        dp_rank: this rank's replica, 0..N-1.
        pp_rank: this rank's stage, 0..P-1.
        pp_group: this replica's stages (None with one replica: the world, as without ``--dp``).
        dp_group: this stage's replicas (None with one replica: there is nothing to reduce).
    """

    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    def rank_of(self, dp_rank: int, pp_rank: int) -> int:
        """The global rank of replica ``dp_rank``'s stage ``pp_rank``."""
        return dp_rank * self.pp_size + pp_rank


def make_grid(dp_size: int) -> ReplicaGrid:
    """This rank's place and groups in the ``(dp, pp)`` grid of the whole world.

    A collective call (every rank creates every group, in the same order); the groups take the
    default group's timeout (``dist.timeout_s``), which a DeviceMesh's groups would not (theirs
    is the backend's default, 30 minutes on gloo).

    Raises:
        ValueError: ``dp_size`` does not divide the world size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp_size < 1 or world % dp_size:
        raise ValueError(f"pipeline.dp_size={dp_size} does not divide the {world} ranks into equal replicas")
    stages = world // dp_size
    dp_rank, pp_rank = divmod(rank, stages)
    if dp_size == 1:
        return ReplicaGrid(1, stages, 0, rank, None, None)
    timeout = default_group_timeout()
    pp_group = dp_group = None
    for d in range(dp_size):  # every rank creates every group, in one order
        group = dist.new_group([d * stages + p for p in range(stages)], timeout=timeout)
        pp_group = group if d == dp_rank else pp_group
    for p in range(stages):
        group = dist.new_group([d * stages + p for d in range(dp_size)], timeout=timeout)
        dp_group = group if p == pp_rank else dp_group
    return ReplicaGrid(dp_size, stages, dp_rank, pp_rank, pp_group, dp_group)


def replica_shares(batch_size: int, length: int, dp_size: int, micro_batches: int = 1) -> list[np.ndarray]:
    """The rows of a step's batch each replica trains on, from poise's step split
    (:func:`poise.balance.sharding.split_step`: LPT on padded cost over speed).

    The split's unit is ``micro_batches`` rows (unit j: rows j·m … j·m + m − 1), since torch's
    pipelining cuts a replica's share into equal micro-batches (it sizes every micro-batch's
    buffers from the first one), so a share must be a multiple of m. Why the units come out
    equal (the shares differ by at most one unit, m samples): the pipeline pads every sample to
    ``length`` (each stage is set up for the first step's shapes), so every sample costs the
    same, and the replicas run the same stages on the same kind of device with no speed
    measured. What still differs between shares is the number of real target tokens; the loss
    weight (:func:`replica_weight`) makes the step exact whatever the shares. The split depends
    only on its arguments: the same at every step (fixed shapes) and on every rank.

    Raises:
        ValueError: ``batch_size`` is not a multiple of ``micro_batches``, or holds fewer than
            ``micro_batches`` rows per replica.
    """
    units, rest = divmod(batch_size, micro_batches)
    if rest or units < dp_size:
        raise ValueError(f"a batch of {batch_size} samples cannot be cut into {dp_size} replica share(s) of "
                         f"pipeline.micro_batches={micro_batches} equal micro-batches: give a multiple of "
                         f"{micro_batches}, at least {micro_batches * dp_size}")
    split = split_step(np.arange(units), np.full(units, length), linear_cost(), np.ones(dp_size))
    return [(unit[:, None] * micro_batches + np.arange(micro_batches)).reshape(-1) for unit in split.batches]


def replica_weight(targets: torch.Tensor, shares: Sequence[np.ndarray], dp_rank: int) -> float:
    """Replica ``dp_rank``'s loss weight ``N · n_d / Σ n`` for one step, ``n`` counting real
    target tokens (``targets``: the whole step's ``[B, L]``, ignored positions excluded). 1.0
    with one replica; every rank computes every replica's weight alike, with no communication."""
    terms = (targets != IGNORE_INDEX).sum(dim=1).numpy()
    return loss_weight(list(shares), dp_rank, loss_terms=terms)


def check_comm(config: CommConfig, backend: str) -> None:
    """Raise a one-line ValueError for a ``comm`` setting that DDP over the replicas cannot run.

    - ``collective`` other than ``flat``: the others discover the node layout and create
      groups of their own, a collective call over the world that each replica group would make
      on its own.
    - ``codec=auto``: its PowerSGD trial is timed by the training session's steps, which the
      pipeline does not run.
    - ``local_first``: each replica would keep its own unsent gradient, so the replicas of a
      stage would differ while the pipeline needs them alike.
    """
    comm_builder.check_backend(config, backend)
    if config.collective != "flat":
        raise ValueError(f"comm.collective={config.collective!r} with pipeline.dp_size > 1: the replicas reduce "
                         "with 'flat' only (the stages' replicas already span the nodes)")
    if config.codec == "auto":
        raise ValueError("comm.codec='auto' with pipeline.dp_size > 1: its trial times training-session steps; "
                         "name a codec (e.g. fp16, int8, powersgd)")
    if config.local_first:
        raise ValueError("comm.local_first with pipeline.dp_size > 1: the replicas of a stage must stay alike")


@dataclass(frozen=True)
class ReplicaTraffic:
    """One step's DDP reduction on one rank.

    Attributes:
        raw_bytes: gradient bytes handed to the hook.
        wire_bytes: bytes this rank put into the ``dp`` collectives.
        comm_s: seconds at least one bucket was in flight.
        exposed_s: the part of ``comm_s`` after this rank's last bucket was ready: time the
            stage's last backward waited for its replicas (counted in its measured compute by
            :class:`~poise.pipeline.stage.TimedStage`, taken out of it by the worker).
    """

    raw_bytes: int
    wire_bytes: int
    comm_s: float
    exposed_s: float


class ReplicaSync:
    """A stage module wrapped in DDP over its replicas, with poise's comm hook behind the probe.

    Args:
        module: this rank's stage (:func:`poise.pipeline.stage.stage_layers`).
        config: the codec, error feedback and bucket size (see :func:`check_comm`).
        group: the stage's ``dp`` group.
        backend: the process group's backend.
        compression_start: optimizer steps sent uncompressed first.
        device: where the stage runs (picks the clock: CUDA events on a GPU).

    Attributes:
        model: the DDP module to hand to :class:`~poise.pipeline.stage.StageRunner`.
        state: the hook's state (bytes per step; residuals).
    """

    def __init__(self, module: nn.Module, config: CommConfig, *, group: dist.ProcessGroup, backend: str,
                 compression_start: int, device: torch.device) -> None:
        check_comm(config, backend)
        bucket_cap_mb = config.bucket_mb
        if comm_builder.requires_single_bucket(config):  # torch's PowerSGD hook on gloo
            bucket_cap_mb = 2 * sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20 + 1
        self.model = DistributedDataParallel(module, process_group=group, bucket_cap_mb=bucket_cap_mb,
                                             device_ids=[device.index] if device.type == "cuda" else None)
        hook, self.state = comm_builder.build(config, process_group=group, start_step=compression_start)
        self.clock = clock_for(device)
        self.probe = BucketProbe(self.clock)
        self.model.register_comm_hook(self.state, instrumented(hook, self.probe))
        self._origin: Any = self.clock.mark()

    def begin_step(self) -> None:
        """Zero the counters and the probe; call before each step."""
        self.probe.reset()
        self.state.reset_step()
        self._origin = self.clock.mark()

    def end_step(self) -> ReplicaTraffic:
        """This step's bytes and seconds (read after the step)."""
        stats = self.state.step_stats()
        comm = exposed = 0.0
        if self.probe.last_ready is not None:
            comm, hidden = self.probe.comm_overlap(self.probe.last_ready, self._origin)
            exposed = comm - hidden
        return ReplicaTraffic(stats.raw_bytes, stats.wire_bytes, comm, exposed)
