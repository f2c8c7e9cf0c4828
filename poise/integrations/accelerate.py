"""poise in Hugging Face Accelerate: :func:`attach`, a :class:`poise.Session` bound to an ``Accelerator``.

After ``model, optimizer = accelerator.prepare(model, optimizer)``, ``attach(accelerator,
model, lengths=..., ...)`` makes the session on the DDP model Accelerate built (poise's codec
hook and timing probe on it) with ``backward=accelerator.backward`` (its grad scaler under
mixed precision). The loop is then a session loop (``poise/run/session.py``)::

    accelerator = Accelerator(cpu=True)       # torchrun on CPU: MULTI_CPU over gloo
    model, optimizer = accelerator.prepare(model, optimizer)
    session = attach(accelerator, model, lengths=lengths, batch_size=16, comm="fp16", out_dir="runs/a")
    loader = session.dataloader(dataset, collate_fn=collate)   # NOT accelerator.prepare(loader)
    for step, batch in session.steps(loader):
        batch = batch.to(accelerator.device)
        step.backward(loss_fn(session.model(batch)))           # weighted, then accelerator.backward
        optimizer.step()
        optimizer.zero_grad()
    session.finish()
    accelerator.end_training()                                 # destroys the process group

The training DataLoader must not go through ``accelerator.prepare``: Accelerate would shard
its batches a second time (each rank taking every other batch of its own plan), and the
session would weight batches it is not given. Batches are not moved for you: ``.to(accelerator.device)``.
Gradient accumulation is the session's (``accum_steps=``, step the optimizer when
``step.sync``), not Accelerate's: its ``gradient_accumulation_steps`` must stay 1.

Under ``torchrun --nproc-per-node N`` on a machine without GPUs, ``Accelerator(cpu=True)``
reads torchrun's environment and runs MULTI_CPU on gloo; without ``cpu=True`` Accelerate sees no
device to spread over and runs N separate single-process jobs, which :func:`attach` refuses.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError:
    raise ImportError("poise.integrations.accelerate needs accelerate: pip install 'poise[accelerate]'") from None

from poise.run.session import Session

log = logging.getLogger(__name__)


def attach(accelerator: Accelerator, model: nn.Module, **session_kwargs: Any) -> Session:
    """A :class:`poise.Session` on ``model``, the DDP model ``accelerator.prepare`` returned.

    Args:
        accelerator: the run's Accelerator (its process group is the session's).
        model: the prepared model, as ``accelerator.prepare`` returned it.
        **session_kwargs: :meth:`poise.Session.from_kwargs`'s keywords (:class:`poise.Data`'s
            ``lengths``, ``loss_terms``, ``batch_size``, ``accum_steps``, ...; the session's
            ``balance``, ``comm``, ``out_dir``, ...), same units. The session's ``backward`` is
            ``accelerator.backward``.

    Returns:
        The session; ``session.model`` is ``model`` with poise's comm hook registered.

    Raises:
        ValueError: one line, when Accelerate runs one process, shards the model (FSDP,
            DeepSpeed, Megatron), accumulates gradients itself, or ``model`` is not its DDP model.
    """
    kind = accelerator.distributed_type
    if kind == DistributedType.NO:
        raise ValueError("attach(): Accelerate runs a single process here, so there is nothing to balance or "
                         "compress: launch with torchrun/accelerate launch, and on CPU pass Accelerator(cpu=True)")
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ValueError(f"attach(): Accelerate runs {kind.value}, which shards or reduces gradients without DDP; "
                         "poise's comm hook and balanced steps need plain DDP (a MULTI_* distributed type)")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"attach(): Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps})"
                         " would divide the weighted loss again: accumulate with attach(..., accum_steps=N) and "
                         "step the optimizer when step.sync")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"attach(): model is a {type(model).__name__}, not the DistributedDataParallel model "
                         "accelerator.prepare(model, optimizer) returns (pass that one; torch.compile it later)")
    session = Session.from_kwargs(model, **session_kwargs)
    session.backward = accelerator.backward  # its grad scaler under mixed precision
    session.add_listener(_UnpreparedLoader(accelerator, session.sampler))
    return session


class _UnpreparedLoader:
    """A step listener that refuses, before a step trains, a session loader that went through
    ``accelerator.prepare``: Accelerate wraps its batch sampler in a shard that takes every
    other batch of the session's plan, so the batch in hand is not the one the step weights
    and samples are skipped (a loader for evaluation may be prepared: it is not the session's)."""

    def __init__(self, accelerator: Accelerator, sampler: object) -> None:
        self.accelerator, self.sampler = accelerator, sampler

    def step_began(self, index: int) -> None:
        for loader in getattr(self.accelerator, "_dataloaders", ()):
            batch_sampler = getattr(loader, "batch_sampler", None)
            if batch_sampler is not None and getattr(batch_sampler, "batch_sampler", None) is self.sampler:
                raise ValueError("the session's DataLoader went through accelerator.prepare: Accelerate shards its "
                                 "batches again (each rank takes every other batch of its own plan), so the batch "
                                 "in hand is not the one the step weights; use session.dataloader(dataset) as it "
                                 "is, without prepare")

    def step_ended(self, index: int) -> None:
        """Nothing to check after a step."""

    def injected_s(self) -> float:
        return 0.0


__all__ = ["attach"]
