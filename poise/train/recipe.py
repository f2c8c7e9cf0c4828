"""The training recipe ``poise train`` and ``poise pipeline`` share: seeds, the optimizer, the
learning-rate schedule and its span, frozen parameters, and the clipped optimizer step.

Each is a plain function of the config, so the data-parallel loop (:mod:`poise.train.loop`)
and the pipeline's stages (:mod:`poise.pipeline.worker`) train with the same rules: a run
that changes the warm-up or the clipping changes it for both.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from poise.comm import registry
from poise.config import RunConfig
from poise.runtime.fsdp import is_dtensor
from poise.tasks.base import Task
from poise.train.optim import AdamW

if TYPE_CHECKING:
    from poise.run.session import Session

log = logging.getLogger(__name__)


def seed_everything(seed: int, rank: int) -> None:
    """Seed python, numpy and torch; ranks get distinct streams (dropout etc.)."""
    random.seed(seed * 1000 + rank)
    np.random.seed(seed * 1000 + rank)
    torch.manual_seed(seed * 1000 + rank)


def make_optimizer(params: Any, config: RunConfig, task: Task, compression_start: int | None = None) -> AdamW:
    """AdamW with the run's learning rate and weight decay, fused: one kernel over every
    parameter instead of a Python loop (about 6x faster on CPU for a 19M-parameter model,
    which matters once compression has taken communication out of the step). With
    ``comm.freeze_variance`` its second moment freezes when compression starts, after
    ``compression_start`` optimizer steps (see ``poise/train/optim.py``; None: nothing is
    compressed)."""
    freeze_variance = compression_start is not None and registry.freezes_variance(config.comm)
    freeze_after = max(1, compression_start) if freeze_variance else None
    return AdamW(params, lr=config.train.lr or task.default_lr, weight_decay=config.train.weight_decay,
                 fused=True, freeze_after=freeze_after)


def lr_warmup(warmup_steps: int, total_steps: int) -> int:
    """The warm-up :func:`lr_schedule` uses, in optimizer steps: ``warmup_steps``, at most a
    tenth of a short run."""
    return min(warmup_steps, max(1, total_steps // 10))


def schedule_span(config: RunConfig, session: Session, optimizer_steps: int) -> Callable[[], int]:
    """The learning-rate schedule's span, in optimizer steps: ``train.schedule_steps`` (default
    the whole run) while gradients go exact, the whole run once they go lossy (a lossy codec, or
    ``auto`` keeping PowerSGD), because each lossy step is worth less and the run's extra steps
    are there for it. So ``auto`` that drops PowerSGD follows plain DDP's schedule, step for step."""
    exact_span = config.train.schedule_steps or optimizer_steps
    codec = session.comm.codec  # as named, or as the session decided
    if codec != "auto":
        span = optimizer_steps if registry.codec(codec).lossy else exact_span
        return lambda: span
    trial = session.codec_trial
    return lambda: optimizer_steps if trial is not None and trial.choice else exact_span


def lr_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int | Callable[[], int]
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to 10% of the peak at ``total_steps``, where it stays
    (a run longer than its schedule trains on at that rate); both in optimizer steps.
    ``total_steps`` may be a function, read at every step: :func:`schedule_span`'s span is
    known only once ``comm.codec=auto`` chose."""
    span = total_steps if callable(total_steps) else lambda: total_steps

    def factor(step: int) -> float:
        total = span()
        warmup = lr_warmup(warmup_steps, total)
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def freeze(model: torch.nn.Module, prefixes: tuple[str, ...]) -> None:
    """Keep the parameters whose names start with one of ``prefixes`` fixed (fine-tuning).

    Raises:
        ValueError: for a prefix that names no parameter, or when nothing would be trained.
    """
    names = [n for n, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(n.startswith(prefix) for n in names):
            roots = sorted({n.split(".")[0] for n in names})
            raise ValueError(f"train.frozen: {prefix!r} names no parameter; top-level names are {', '.join(roots)}")
    for name, param in model.named_parameters():
        if name.startswith(prefixes):
            param.requires_grad_(False)
    if prefixes and not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"train.frozen={','.join(prefixes)!r} freezes every parameter: nothing would train")


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also clips a model sharded with FSDP2: there each
    rank's gradients are shards (DTensors), their norm a partial one until it is reduced over
    the shards (``full_tensor``, a collective), and every rank clips by that whole norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not any(is_dtensor(p) for p in params):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, grad_clip_norm: float, step: int,
                  on_nonfinite: str = "skip", rank: int = 0) -> bool:
    """Clip the gradient norm, step the optimizer and the schedule; True when skipped.

    The total norm is needed anyway for clipping; it also tells whether the reduced gradient
    is finite. A NaN/Inf that a codec let through (``comm.on_nonfinite='skip'``) skips the
    optimizer on every rank alike, since every rank holds the same reduced gradient; with
    ``on_nonfinite='error'`` it raises FloatingPointError naming ``step`` and ``rank`` instead.
    """
    norm = clip_grad_norm(model, grad_clip_norm if grad_clip_norm > 0 else math.inf)
    skipped = not math.isfinite(float(norm))
    if skipped and on_nonfinite == "error":
        raise FloatingPointError(f"gradient norm is {float(norm)} at step {step} on rank {rank} "
                                 "(comm.on_nonfinite='skip' skips such steps instead)")
    if skipped:
        log.warning("step %d: gradient norm is %s: optimizer step skipped", step, float(norm))
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return skipped
