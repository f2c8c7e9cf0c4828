"""Every-step synchronization: DDP's all-reduce of gradient buckets through poise's comm hook.

The model is wrapped in DistributedDataParallel (or a DDP model is taken as it is) and the
hook that :func:`poise.comm.builder.build` makes for the ``CommConfig`` (a codec with error
feedback over a collective; ``auto``'s PowerSGD trial; torch's own hooks) is registered
behind the timing probe. Hook wrappers compose around it: ``outer`` ones see a bucket before
the probe does (an emulated slower device must count as compute), ``inner`` ones after it,
before the codec (the ``deadline+stale`` stash keeps the bucket as the rank computed it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from poise.comm import builder as comm_builder
from poise.comm.probe import BucketProbe, CommHook, instrumented
from poise.comm.settle import settle_buckets
from poise.comm.state import StepStats
from poise.comm.topology import spans_nodes
from poise.comm.trial import CodecTrial
from poise.config import CommConfig
from poise.runtime.clock import Clock
from poise.sync.base import LossScope

log = logging.getLogger(__name__)

HookWrapper = Callable[[CommHook], CommHook]


class AllReduce:
    """Gradients reduced in every step's backward (see module doc); a :class:`~poise.sync.Sync`.

    Args:
        model: a plain module (wrapped here in DDP) or a DDP model with no comm hook yet.
        config: the codec, error feedback, collective and bucket size.
        clock: what the probe's marks are (host seconds, or CUDA events).
        backend: the process group's backend (``gloo``, ``nccl``).
        compression_start: optimizer steps sent uncompressed first.
        outer, inner: hook wrappers, applied around the probe and around the codec's hook.
        process_group: the ranks that average gradients (None: the world; a node's ranks under
            ``sync.inner_scope=node``).

    Raises:
        ValueError: a codec that cannot run on ``backend``, or a DDP model whose buckets do
            not suit the codec.
    """

    loss_scope = LossScope()  # every rank: DDP's (FSDP2's) mean over the world
    replicas_agree = True

    def __init__(self, model: nn.Module, config: CommConfig, *, clock: Clock, backend: str,
                 compression_start: int, outer: Sequence[HookWrapper] = (),
                 inner: Sequence[HookWrapper] = (), process_group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self.probe = BucketProbe(clock)
        self.model = self._ddp(model, backend, process_group)
        hook, self.state = comm_builder.build(config, process_group, start_step=compression_start)
        for wrap in inner:
            hook = wrap(hook)
        hook = instrumented(hook, self.probe)
        for wrap in outer:
            hook = wrap(hook)
        self._expected = False  # inside backward(): reductions are the step's
        self.model.register_comm_hook(self.state, _refuse_outside(hook, lambda: self._expected))
        self._no_sync = NoSync(self.model)
        # the backend's own all-reduce over ranks on several nodes: every byte crosses a node
        # link somewhere (only the hierarchical and local-first reducers split the count)
        self._all_inter_node = (config.collective == "flat" and not config.local_first
                                and spans_nodes(dist.get_process_group_ranks(process_group or dist.group.WORLD)))

    def _ddp(self, model: nn.Module, backend: str, group: dist.ProcessGroup | None) -> DistributedDataParallel:
        comm_builder.check_backend(self.config, backend)
        single = comm_builder.requires_single_bucket(self.config)
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if isinstance(model, DistributedDataParallel) and group is not None:
            raise ValueError("a DDP model with a node's process group: give the plain module, which is wrapped in "
                             "DDP over the node's ranks here (sync.inner_scope='node')")
        if isinstance(model, DistributedDataParallel):
            if single and model.bucket_bytes_cap < size_mb * 2**20:
                raise ValueError(f"comm.codec={self.config.codec!r} needs one bucket on gloo: build DDP with "
                                 f"bucket_cap_mb > {size_mb:.1f} (the model's size in MB)")
            return model
        bucket_cap_mb = self.config.bucket_mb
        if single:
            bucket_cap_mb = 2 * size_mb + 1
            log.info("comm.codec=%r needs a single bucket on gloo: bucket size %.1f MB instead of comm.bucket_mb",
                     self.config.codec, bucket_cap_mb)
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       bucket_cap_mb=bucket_cap_mb, process_group=group)

    @property
    def trial(self) -> CodecTrial | None:
        """``comm.codec=auto``'s decision (None for other codecs)."""
        return self.state.trial

    # -- the call points -------------------------------------------------------------------

    def begin_step(self, index: int) -> None:
        self.probe.reset()
        self.state.reset_step()

    def micro_batch(self, last: bool) -> None:
        self._no_sync.reduce_next(last)

    def backward(self, run: Callable[[], None]) -> None:
        self._expected = True
        try:
            run()
        finally:
            self._expected = False

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        """Nothing: every step's gradient was reduced in its backward."""

    def between_steps(self) -> bool:
        return self.state.between_steps()

    def conclude(self) -> bool:
        """Nothing: every step's gradient was reduced, so the replicas agree."""
        return True

    def traffic(self) -> tuple[StepStats, StepStats]:
        step = self.state.step_stats()
        return step, step if self._all_inter_node else self.state.inter_node_stats()

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """DDP's bucket layout settled before residuals are restored (:mod:`poise.comm.settle`)."""
        self.backward(lambda: settle_buckets(self.model, self.state, forward_backward))

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

    def shared_state_dict(self) -> dict[str, Any]:
        return self.state.shared_state_dict()

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_shared_state_dict(state)

    def summary(self) -> dict[str, Any]:
        return {"mode": "step"}


class NoSync:
    """DDP's ``no_sync`` held across calls: :meth:`reduce_next` enters it before a forward that
    only accumulates (it must cover the forward: DDP arms the reduction there) and leaves it
    before the one that reduces, and at the end of a step."""

    def __init__(self, model: DistributedDataParallel) -> None:
        self.model = model
        self._context: contextlib.AbstractContextManager[Any] | None = None

    def reduce_next(self, last: bool) -> None:
        if last and self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
        elif not last and self._context is None:
            self._context = self.model.no_sync()
            self._context.__enter__()


def _refuse_outside(hook: CommHook, expected: Callable[[], bool]) -> CommHook:
    """``hook``, refusing (one-line ValueError, raised out of ``backward()``) a bucket that
    arrives outside the step's backward: a plain ``loss.backward()`` would reduce an unweighted
    gradient, untimed, and the optimizer would apply it. DDP then needs a new step; the
    script needs ``step.backward(loss)``.

    (No annotations on the inner function: DDP compares them with real classes at
    registration, and this module's are postponed strings.)
    """

    def step_hook(state, bucket):  # type: ignore[no-untyped-def]
        if not expected():
            raise ValueError("a gradient bucket was reduced outside step.backward(loss): call step.backward(loss), "
                             "not loss.backward(), so the loss is weighted and timed (nothing was applied: stop "
                             "here and fix the loop)")
        return hook(state, bucket)

    return step_hook


__all__ = ["AllReduce", "HookWrapper", "NoSync"]
