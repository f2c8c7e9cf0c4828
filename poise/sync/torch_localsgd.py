"""torch's post-local SGD, as a :class:`~poise.sync.Sync`, for comparison (``--sync torch-localsgd``).

What torch ships for it (Lin et al., "Don't use large mini-batches, use local SGD", ICLR 2020,
https://arxiv.org/abs/1808.07217), used as its docs show: DDP with ``post_localSGD_hook``
(``PostLocalSGDState``) and a ``PeriodicModelAverager(period=H, warmup_steps=W)`` whose rule
runs after every optimizer step (see :meth:`TorchLocalSGD.end_step` for why its averaging
function is called directly). For the first ``W`` optimizer steps the hook all-reduces every
gradient bucket over the whole world (plain DDP); from then on only within the rank's
subgroup, and the averager all-reduces the parameters over the world every ``H`` steps
(``H = sync.inner_steps``; ``W`` is the run's uncompressed warm-up, ``comm.start_step``).

The subgroups: torch's ``subgroup=None`` makes ``dist.new_subgroups()`` at the first local
step, one subgroup per machine sized by ``torch.cuda.device_count()`` (on a CPU-only machine
that call raises ``ValueError``). The faithful equivalent here is one subgroup per node of
``LOCAL_WORLD_SIZE`` consecutive ranks (torchrun's workers per node, the count torch takes the
GPUs for; torchrun numbers ranks node after node), made by torch's own
``dist.new_subgroups(group_size=...)`` in the constructor, on every rank at the same point,
rather than lazily on DDP's autograd thread in the middle of a backward. On the emulated
cluster (``--cluster 2:2``) the subgroups are the two nodes: after the warm-up, gradients
cross only each node's own loopback and the parameter average is all that crosses nodes.

Loss weighting (``loss_scope``: the rank alone): each rank trains on its own batch's mean loss, as
torch's users do. poise's exact weights (``world × share``) assume an average over the world;
inside a subgroup they would scale a node's gradient by its share of the step's tokens, and the
averager averages parameters equally whatever each rank trained. With equal batches (the
benchmark's) the two agree. ``replicas_agree = False``: between averages the nodes' parameters
and every rank's optimizer state differ, so a checkpoint keeps each rank's own.

Traffic, counted honestly as the bytes this rank hands to collectives: each gradient bucket
(all of them cross nodes during the warm-up, none after it unless the subgroup spans nodes),
and the parameters' bytes at each average (they cross nodes). The inter-node counters hold the
part of it given to collectives whose group spans more than one node.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from poise.comm.probe import BucketProbe, instrumented
from poise.comm.settle import settle_buckets
from poise.comm.state import CountingState, StepStats
from poise.comm.topology import default_group_timeout, spans_nodes
from poise.config import CommConfig
from poise.config.sync import SyncConfig
from poise.runtime.clock import Clock
from poise.sync.allreduce import HookWrapper, NoSync
from poise.sync.base import LossScope


class _LocalSGDState(CountingState):
    """torch's ``PostLocalSGDState`` with poise's counters; the hook's state."""

    def __init__(self, torch_state: PostLocalSGDState, spans_nodes: bool, subgroup_size: int) -> None:
        super().__init__()
        self.torch_state = torch_state
        self.spans_nodes = spans_nodes  # the world's collectives cross nodes
        self.subgroup_size = subgroup_size
        self.expected = False  # inside Sync.backward()


def _counting_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: refuse a bucket outside the step's backward, count it, run torch's
    ``post_localSGD_hook`` (bypassed: a plain world average that counts no iteration).

    (No annotations: DDP compares them with real classes at registration.)
    """
    if not state.expected:
        raise ValueError("a gradient bucket was reduced outside step.backward(loss): call step.backward(loss), "
                         "not loss.backward(), so the step is timed (nothing was applied: stop here and fix the loop)")
    if state.bypassing:
        return default_hooks.allreduce_hook(None, bucket)
    ps: PostLocalSGDState = state.torch_state
    buffer = bucket.buffer()
    size = buffer.numel() * buffer.element_size()
    if ps.iter < ps.start_localSGD_iter:  # the warm-up: a world all-reduce
        state.counters.add(raw_bytes=size, wire_bytes=size, buckets=1)
        if state.spans_nodes:
            state.inter_node_counters.add(raw_bytes=size, wire_bytes=size, buckets=1)
    elif ps.post_local_gradient_allreduce and state.subgroup_size > 1:  # within the node
        state.counters.add(raw_bytes=size, wire_bytes=size, buckets=1)
    return post_localSGD_hook(ps, bucket)


class TorchLocalSGD:
    """torch's post-local SGD (see module doc); a :class:`~poise.sync.Sync`.

    Args:
        model: a plain module (wrapped here in DDP).
        comm: its ``bucket_mb`` sizes DDP's buckets; the codec must be ``none`` (torch's hook).
        sync: ``inner_steps`` is the averaging period H.
        clock: what the probe's marks are.
        backend: the process group's backend (torch's hook runs on any).
        compression_start: optimizer steps of plain DDP first, W (torch's
            ``start_localSGD_iter`` and the averager's ``warmup_steps``, equal as its docs require).
        outer: hook wrappers applied around the probe (an emulated slower device).
        ranks_per_node: ranks per subgroup (None: ``LOCAL_WORLD_SIZE``, else the world).

    Raises:
        ValueError: one line, for a codec or collective other than torch's own hook, or a
            world that the subgroups do not divide.
    """

    loss_scope: LossScope
    replicas_agree = False
    trial = None  # no comm.codec=auto trial: the recorder reads it

    def __init__(self, model: nn.Module, comm: CommConfig, sync: SyncConfig, *, clock: Clock, backend: str,
                 compression_start: int, outer: Sequence[HookWrapper] = (), ranks_per_node: int | None = None) -> None:
        warmup_steps = compression_start
        if not comm.exact or comm.collective != "flat":
            raise ValueError(f"sync.mode='torch-localsgd' runs torch's post_localSGD_hook: comm.codec={comm.codec!r} "
                             f"and comm.collective={comm.collective!r} must stay 'none' and 'flat'")
        if warmup_steps < 0:
            raise ValueError(f"torch-localsgd: compression_start={warmup_steps} (the warm-up) must be >= 0")
        world = dist.get_world_size()
        size = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if not 1 <= size <= world or world % size:
            raise ValueError(f"torch-localsgd: {size} ranks per node do not divide the world of {world} ranks into "
                             "nodes (LOCAL_WORLD_SIZE)")
        self.sync = sync
        self.loss_scope = LossScope.alone(dist.get_rank())  # torch's hooks average each rank's own mean
        self.warmup_steps = warmup_steps
        self.ranks_per_node = size
        subgroup, _ = dist.new_subgroups(group_size=size, timeout=default_group_timeout())
        self.probe = BucketProbe(clock)
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                             bucket_cap_mb=comm.bucket_mb)
        self.state = _LocalSGDState(PostLocalSGDState(process_group=None, subgroup=subgroup,
                                                      start_localSGD_iter=warmup_steps),
                                    spans_nodes=spans_nodes(range(world), size), subgroup_size=size)
        hook = instrumented(_counting_hook, self.probe)
        for wrap in outer:
            hook = wrap(hook)
        self.model.register_comm_hook(self.state, hook)
        self.averager = PeriodicModelAverager(period=sync.inner_steps, warmup_steps=warmup_steps)
        self._trainable = [p for p in params if p.requires_grad]
        self._param_bytes = sum(p.numel() * p.element_size() for p in self._trainable)
        self._no_sync = NoSync(self.model)
        self.averages = 0

    # -- the call points -------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        self.probe.reset()
        self.state.reset_step()

    def micro_batch(self, last: bool) -> None:
        """DDP's ``no_sync`` around the forwards that only accumulate (as ``AllReduce``)."""
        self._no_sync.reduce_next(last)

    def backward(self, run: Callable[[], None]) -> None:
        self.state.expected = True
        try:
            run()
        finally:
            self.state.expected = False

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        """After an optimizer step: ``PeriodicModelAverager.average_parameters``'s rule and
        torch's averaging function (``model_averaging.utils.average_parameters``, one flat
        all-reduce over the world) on the parameters that require a gradient.

        Why not the averager's method itself: it averages only parameters whose ``.grad`` is
        set, and a loop that clears gradients in its optimizer step (``poise train``'s does,
        with ``set_to_none``) would leave it nothing to average (``torch.cat`` of an empty list).
        """
        if not optimizer_step:
            return
        a = self.averager
        if a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0:
            self.averages += 1
            self.state.counters.add(raw_bytes=self._param_bytes, wire_bytes=self._param_bytes)
            if self.state.spans_nodes:
                self.state.inter_node_counters.add(raw_bytes=self._param_bytes, wire_bytes=self._param_bytes)
            averaging.average_parameters(iter(self._trainable), a.process_group)
        a.step += 1

    def between_steps(self) -> bool:
        return False

    def conclude(self) -> bool:
        """One last average of the parameters if any optimizer step came after the last one
        (torch's averager leaves each rank its own otherwise)."""
        a = self.averager
        if a.step <= a.warmup_steps or (a.step - a.warmup_steps - 1) % a.period == 0:
            return True  # still DDP's warm-up, or the last step averaged
        self.averages += 1
        averaging.average_parameters(iter(self._trainable), a.process_group)
        return True

    def traffic(self) -> tuple[StepStats, StepStats]:
        return self.state.step_stats(), self.state.inter_node_stats()

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """DDP's bucket layout settled with the hook bypassed (torch's iteration not counted)."""
        self.backward(lambda: settle_buckets(self.model, self.state, forward_backward))

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.shared_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_shared_state_dict(state)

    def shared_state_dict(self) -> dict[str, Any]:
        """torch's two step counts (the hook's iteration, the averager's step): alike on every rank."""
        return {"iter": self.state.torch_state.iter, "averager_step": self.averager.step, "averages": self.averages}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.state.torch_state.iter = int(state.get("iter", 0))
        self.averager.step = int(state.get("averager_step", 0))
        self.averages = int(state.get("averages", 0))

    def summary(self) -> dict[str, Any]:
        return {"mode": "torch-localsgd", "inner_steps": self.sync.inner_steps, "warmup_steps": self.warmup_steps,
                "ranks_per_subgroup": self.ranks_per_node, "outer_steps": self.averages}


__all__ = ["TorchLocalSGD"]
