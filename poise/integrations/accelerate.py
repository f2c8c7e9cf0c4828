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

FSDP2 (a model sharded with ``fully_shard``; the session runs :class:`poise.sync.Sharded`), two ways:

- Accelerate's own: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``
  (or ``accelerate launch`` with an FSDP2 config): ``prepare`` shards the model and
  :func:`attach` takes the ``FSDPModule`` it returns. Accelerate 1.15 chooses its FSDP type only
  on an accelerator (its ``MULTI_GPU``, ``MULTI_XPU``, ... types): with ``cpu=True`` it drops
  the plugin without a word and prepares DDP, which :func:`attach` refuses (the run would not be
  sharded).
- your own, on any device, CPU included: shard the model yourself (``fully_shard`` each block,
  then the root), prepare only the optimizer, and pass the sharded model::

      accelerator = Accelerator(cpu=True)
      for block in model.blocks:
          fully_shard(block)
      fully_shard(model)
      optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))
      session = attach(accelerator, model, lengths=lengths, batch_size=16, out_dir="runs/a")

  (``accelerator.prepare(model)`` cannot take a sharded model outside its FSDP type: on
  MULTI_CPU it wraps it in DDP, whose first broadcast fails with "Operator
  c10d.broadcast_.default does not have a sharding strategy registered".)

FSDP1 (``fsdp_version=1``), DeepSpeed and Megatron-LM are refused.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ImportError:
    raise ImportError("poise.integrations.accelerate needs accelerate: pip install accelerate==1.15.0 "
                      "(poise's 'accelerate' extra)") from None

from poise.run.session import Session

log = logging.getLogger(__name__)


def attach(accelerator: Accelerator, model: nn.Module, **session_kwargs: Any) -> Session:
    """A :class:`poise.Session` on ``model``: the DDP or FSDP2 model ``accelerator.prepare``
    returned, or a model you sharded with ``fully_shard`` yourself (see the module doc).

    Args:
        accelerator: the run's Accelerator (its process group is the session's).
        model: the prepared model, as ``accelerator.prepare`` returned it (DDP; an
            ``FSDPModule`` under Accelerate's FSDP2), or your own ``fully_shard`` model.
        **session_kwargs: :meth:`poise.Session.from_kwargs`'s keywords (:class:`poise.Data`'s
            ``lengths``, ``loss_terms``, ``batch_size``, ``accum_steps``, ...; the session's
            ``balance``, ``comm``, ``out_dir``, ...), same units. The session's ``backward`` is
            ``accelerator.backward``; ``accelerator.clip_grad_norm_`` (and ``_value_``) refuse
            a call inside a step before its backward (it would clip nothing).

    Returns:
        The session; ``session.model`` is ``model`` with poise's comm hook registered (DDP) or
        poise's reduce-scatter installed (FSDP2).

    Raises:
        ValueError: one line, when Accelerate runs one process, runs FSDP1, DeepSpeed or
            Megatron, dropped an FSDP plugin on CPU, accumulates gradients itself, or ``model``
            is not a DDP or ``fully_shard`` model.
    """
    _check(accelerator, model)
    session = Session.from_kwargs(model, **session_kwargs)
    session.backward = accelerator.backward  # its grad scaler under mixed precision
    session.add_listener(_UnpreparedLoader(accelerator, session.sampler))
    for name in ("clip_grad_norm_", "clip_grad_value_"):  # (an instance attribute: this accelerator only)
        setattr(accelerator, name, _clip_after_backward(session, name, getattr(accelerator, name)))
    return session


def _clip_after_backward(session: Session, name: str, clip: Callable[..., Any]) -> Callable[..., Any]:
    """``accelerator.<name>`` refusing, in one line, a call inside a step before its backward:
    there is no gradient yet, so it would clip nothing and the step's gradient would go to the
    optimizer unclipped without a word."""

    @functools.wraps(clip)
    def checked(*args: Any, **kwargs: Any) -> Any:
        step = session.open_step
        if step is not None and not step.backward_done:
            raise ValueError(f"accelerator.{name}() in step {step.index} before step.backward(loss): there is no "
                             "gradient yet, so it clips nothing; call it after step.backward(loss), before "
                             "optimizer.step()")
        return clip(*args, **kwargs)

    return checked


def _check(accelerator: Accelerator, model: nn.Module) -> None:
    """Refuse, in one line naming what runs, what the session cannot train through Accelerate."""
    kind = accelerator.distributed_type
    if kind == DistributedType.NO:
        raise ValueError("attach(): Accelerate runs a single process here, so there is nothing to balance or "
                         "compress: launch with torchrun/accelerate launch, and on CPU pass Accelerator(cpu=True)")
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ValueError(f"attach(): Accelerate runs FSDP version {accelerator.state.fsdp_plugin.fsdp_version}; "
                         "poise takes FSDP2: FullyShardedDataParallelPlugin(fsdp_version=2), or DDP")
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ValueError(f"attach(): Accelerate runs {kind.value}, which shards or reduces gradients its own way; "
                         "poise takes DDP (a MULTI_* type) or FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2),"
                         " or your own fully_shard model)")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError(f"attach(): Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps})"
                         " would divide the weighted loss again: accumulate with attach(..., accum_steps=N) and "
                         "step the optimizer when step.sync")
    if isinstance(model, FSDPModule):
        return  # Accelerate's FSDP2, or the user's own fully_shard on a MULTI_* type
    if kind == DistributedType.FSDP:
        raise ValueError(f"attach(): model is a {type(model).__name__}, not the FSDP2 module "
                         "accelerator.prepare(model, optimizer) returns (pass that one)")
    if _fsdp_requested() and isinstance(model, DistributedDataParallel):
        raise ValueError(f"attach(): an FSDP plugin was given, but Accelerate runs {kind.value} and prepared DDP "
                         "(it takes FSDP on accelerators only): on CPU, fully_shard the model yourself, prepare "
                         "the optimizer alone and attach the sharded model, or drop the plugin for DDP")
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"attach(): model is a {type(model).__name__}, not the DistributedDataParallel model "
                         "accelerator.prepare(model, optimizer) returns (pass that one; torch.compile it later) "
                         "nor a fully_shard model")


def _fsdp_requested() -> bool:
    """Whether this process asked Accelerate for FSDP (``Accelerator(fsdp_plugin=...)`` sets
    ``ACCELERATE_USE_FSDP``, and so does ``accelerate launch`` with an FSDP config)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


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
