"""Deadline steps as a synchronization strategy: :class:`Deadline`, composed over an :class:`AllReduce`.

Each rank computes micro-batches until the step's shared deadline and reduces during the
backward of its last one (through the inner all-reduce's hook: codec, collective and probe
unchanged); the count rescales the gradient to the exact mean over what every rank computed
(:mod:`poise.sync.deadline.runner`). The step that drives it is
:class:`poise.run.step.DeadlineStep`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from poise.comm.state import StepStats
from poise.comm.trial import CodecTrial
from poise.config import CommConfig, StragglerConfig
from poise.runtime.clock import Clock
from poise.straggler.claims import store_claims
from poise.sync.allreduce import AllReduce, HookWrapper
from poise.sync.base import LossScope
from poise.sync.deadline.runner import DeadlineRunner, Pauses


class Deadline:
    """A :class:`~poise.sync.Sync` whose steps end at a shared deadline (see module doc).

    Args:
        model, comm, clock, backend, compression_start, outer: as :class:`AllReduce`'s.
        config: the straggler settings (mode, micro-batches, slack, predictor).
        rank, world_size: this rank, the number of ranks.
        costs: per-sample cost (any unit); loss_terms: per-sample loss terms (None: one each).
        device: the process group's device (the count's tensor lives there).
        seed: the run's seed (the predictor's).
        pauses: waits outside forward and backward (emulated delays), or None.
    """

    loss_scope = LossScope()  # every rank: DDP's (FSDP2's) mean over the world
    replicas_agree = True

    def __init__(self, model: nn.Module, comm: CommConfig, config: StragglerConfig, *, clock: Clock,
                 backend: str, compression_start: int, rank: int, world_size: int, costs: np.ndarray,
                 loss_terms: np.ndarray | None, device: torch.device, seed: int = 0,
                 outer: Sequence[HookWrapper] = (), pauses: Pauses | None = None) -> None:
        self.runner = DeadlineRunner(config, rank=rank, world_size=world_size, costs=costs, loss_terms=loss_terms,
                                     device=device, seed=seed, claims=store_claims(rank, world_size, device),
                                     pauses=pauses)
        stash = self.runner.stash  # deadline+stale: sees each bucket before the codec does
        self.inner = AllReduce(model, comm, clock=clock, backend=backend, compression_start=compression_start,
                               outer=outer, inner=[stash.wrap] if stash is not None else [])
        self.model, self.probe = self.inner.model, self.inner.probe

    @property
    def trial(self) -> CodecTrial | None:
        """``comm.codec=auto``'s decision (None for other codecs)."""
        return self.inner.trial

    def zero_backward(self) -> None:
        """Join the gradient reduction without a forward pass (see :func:`zero_backward`)."""
        self.inner.backward(lambda: zero_backward(self.inner.model))

    # -- the call points, as the inner all-reduce's ------------------------------------------

    def begin_step(self, index: int) -> None:
        self.inner.begin_step(index)

    def micro_batch(self, last: bool) -> None:
        self.inner.micro_batch(last)

    def backward(self, run: Callable[[], None]) -> None:
        self.inner.backward(run)

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        self.inner.end_step(index, tokens=tokens, optimizer_step=optimizer_step)

    def between_steps(self) -> bool:
        return self.inner.between_steps()

    def conclude(self) -> bool:
        return self.inner.conclude()

    def traffic(self) -> tuple[StepStats, StepStats]:
        return self.inner.traffic()

    def settle(self, forward_backward: Callable[[], None]) -> None:
        self.inner.settle(forward_backward)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def shared_state_dict(self) -> dict[str, Any]:
        return self.inner.shared_state_dict()

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_shared_state_dict(state)

    def summary(self) -> dict[str, Any]:
        return {"mode": "step", "straggler": True}


def zero_backward(model: DistributedDataParallel) -> None:
    """Join DDP's gradient reduction without a forward pass: a zero loss that reaches every
    trainable parameter, run through DDP's forward bookkeeping (``_pre_forward`` /
    ``_post_forward``, which arm the reducer as a forward would; torch has no public call for
    this), so each bucket is handed to the comm hook with this rank's accumulated gradient
    (zeros if it computed nothing) and every rank joins every all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    model._pre_forward()
    zero = torch.stack([p.reshape(-1)[0] for p in params]).sum() * 0.0
    zero = model._post_forward(zero)
    zero.backward()


__all__ = ["Deadline", "zero_backward"]
