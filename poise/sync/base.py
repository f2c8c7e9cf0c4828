"""The synchronization strategy: the one object a training step calls to meet the other ranks.

Every way poise synchronizes ranks is an implementation of :class:`Sync`, and the step
(:mod:`poise.run.step`) calls it at fixed points only, never by kind:

1. The strategy's constructor wraps the model once, when the session is built: ``model`` is
   what the user trains (DDP with a comm hook; a ``fully_shard`` module as it is).
2. :meth:`Sync.begin_step` when a step opens, before its first forward: per-step counters.
3. :meth:`Sync.micro_batch` before each micro-batch's forward: ``last=True`` when the
   backward that follows must reduce the gradient, False when it only accumulates
   (``no_sync``; FSDP2's ``set_requires_gradient_sync``).
4. :meth:`Sync.backward` runs the step's backward, and with it the hooks the constructor
   registered (codec, collective, probe); a reduction outside it is refused.
5. :meth:`Sync.end_step` after the optimizer step, told the tokens this rank trained in the
   step: where an outer step goes (local SGD, DiLoCo: no communication for H inner steps,
   then an all-reduce of the token-weighted parameter change and an outer optimizer step;
   ``poise/sync/outer.py``).
6. :meth:`Sync.between_steps` after the step is recorded: work outside any step
   (``comm.codec=auto``'s dry runs), whose seconds belong to no step.
7. :meth:`Sync.conclude` once, when the loop is over (``Session.finish``): the replicas meet
   if they drifted apart, so a loop left early ends with one model, not one per rank.

State for checkpoints (:meth:`state_dict`, and the part every rank shares) and the step's
traffic (:meth:`traffic`) complete it. Two flags tell the session how to treat it:
``loss_scope`` (the ranks among whose batches the step weights this rank's loss: every
rank's for DDP; the node's when DDP runs within a node; the rank's own, i.e. its plain mean,
when an outer step weighs the ranks: :class:`LossScope`) and ``replicas_agree`` (False: the ranks' parameters and
optimizer states differ between outer steps, so a checkpoint keeps each rank's own).
Implementations: :class:`poise.sync.AllReduce` (DDP plus a codec over a collective, ``auto``
included), :class:`poise.sync.Deadline` (deadline steps, composed over an ``AllReduce``),
:class:`poise.sync.Outer` (local SGD, DiLoCo, Streaming DiLoCo, composed over DDP's
``no_sync``) and :class:`poise.sync.Sharded` (FSDP2 and HSDP: codecs on FSDP2's reduce-scatter
and on the all-reduce between nodes). ``docs/design.md`` draws the call points.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch.distributed as dist
from torch import nn

from poise.balance.weights import loss_weight
from poise.comm.probe import BucketProbe
from poise.comm.state import StepStats


@dataclass(frozen=True)
class LossScope:
    """The ranks among whose batches a rank's loss is weighted in a step, and their group.

    The step multiplies a rank's mean loss by ``n × its share of the scope's loss terms`` (n: the
    scope's ranks), because the reduction that follows averages over those n ranks: the result is
    the exact mean gradient over every sample of the scope, however unequal the batches.

    Attributes:
        ranks: consecutive ranks (None: every rank of the world, DDP's all-reduce); a range
            of this rank alone means its own mean loss, unweighted (an outer step weighs the
            ranks by their tokens later).
        group: the process group of ``ranks``, to count loss terms over it (None: the world's;
            unused for one rank).
    """

    ranks: range | None = None
    group: dist.ProcessGroup | None = None

    @classmethod
    def alone(cls, rank: int) -> LossScope:
        """This rank's own mean loss, unweighted."""
        return cls(range(rank, rank + 1))

    @property
    def own(self) -> bool:
        """Whether the scope is one rank (its plain mean; nothing to weigh or count)."""
        return self.ranks is not None and len(self.ranks) == 1

    def weight(self, batches: Sequence[np.ndarray], rank: int, loss_terms: np.ndarray | None) -> float:
        """``rank``'s loss weight in a step of ``batches`` (every rank's sample indices)."""
        if self.ranks is None:
            return loss_weight(batches, rank, loss_terms)
        return loss_weight([batches[r] for r in self.ranks], rank - self.ranks.start, loss_terms)


@runtime_checkable
class Sync(Protocol):
    """How one rank's gradients meet the other ranks' (see module doc for the call points).

    Attributes:
        model: the model as the constructor wrapped it (what the user's forward calls).
        probe: marks of when each gradient bucket was handed over and reduced this step
            (the split of backward into compute and communication).
        loss_scope: the ranks this step's loss weight is a share of (see :class:`LossScope`).
        replicas_agree: every rank holds the same parameters after each optimizer step.
    """

    model: nn.Module
    probe: BucketProbe
    loss_scope: LossScope
    replicas_agree: bool

    def begin_step(self, index: int) -> None:
        """A step opens (``index``: steps before it); zero the per-step counters."""

    def micro_batch(self, last: bool) -> None:
        """Before a micro-batch's forward: reduce during its backward only when ``last``."""

    def backward(self, run: Callable[[], None]) -> None:
        """Run a backward of the step (``run``): the only place gradients may be reduced. A
        reduction outside it (a plain ``loss.backward()``) is refused with one line before the
        optimizer can apply an unweighted gradient."""

    def end_step(self, index: int, *, tokens: float, optimizer_step: bool) -> None:
        """After step ``index`` (and its optimizer step, if ``optimizer_step``), in which this
        rank trained ``tokens`` loss terms: an outer step runs here when one is due."""

    def between_steps(self) -> bool:
        """Work outside any step, run on every rank after each step; True if it ran anything."""

    def conclude(self) -> bool:
        """The loop is over, however it ended (the last step, an early stop, a ``break``): on
        every rank alike (``Session.finish``), bring the replicas together if they drifted
        apart (an outer strategy's final synchronization). True if every rank now holds the
        same parameters, False if it cannot say so (the report and the log then tell)."""

    def traffic(self) -> tuple[StepStats, StepStats]:
        """This step's bytes and codec seconds: all of this rank's, and those between nodes."""

    def settle(self, forward_backward: Callable[[], None]) -> None:
        """Before restoring state: one throw-away ``forward_backward`` that changes nothing."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (residuals, warm starts, step count)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def shared_state_dict(self) -> dict[str, Any]:
        """The part of the state every rank holds alike."""

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`shared_state_dict` (this rank's own part starts fresh)."""

    def summary(self) -> dict[str, Any]:
        """What the report says of the strategy (mode, outer steps, an automatic choice and why)."""


__all__ = ["LossScope", "Sync"]
