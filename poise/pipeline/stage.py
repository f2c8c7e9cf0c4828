"""One rank's pipeline stage: its layers, torch's schedule over them, and its measured compute.

A plan (boundary offsets from :func:`poise.balance.partition`) picks this rank's layers; they
run as a ``torch.distributed.pipelining.PipelineStage`` under ``ScheduleGPipe`` or
``Schedule1F1B``. Both work on gloo: every stage runs on the CPU, the p2p sends/receives are
gloo ``isend``/``irecv``, and the schedules only need those plus ``batch_isend_irecv``, which
torch falls back to one-by-one on gloo. (Interleaved and zero-bubble schedules need several
stages per rank and are not offered.)

Measured stage time is the rank's own compute: the seconds spent in the stage's forward and
backward of each micro-batch (and, on the last stage, the loss), excluding the waits for
neighbours. :class:`TimedStage` adds that up around torch's ``forward_one_chunk`` and
``backward_one_chunk``, the two calls every single-stage schedule makes per micro-batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from poise.config import PIPELINE_SCHEDULES
from poise.tasks.base import IGNORE_INDEX

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
assert tuple(SCHEDULES) == PIPELINE_SCHEDULES, "config.PIPELINE_SCHEDULES and SCHEDULES must list the same names"


def stage_layers(layers: Sequence[nn.Module], boundaries: Sequence[int], stage_index: int) -> nn.Sequential:
    """Stage ``stage_index``'s layers ``boundaries[k] … boundaries[k + 1] − 1`` as one module."""
    if not 0 <= stage_index < len(boundaries) - 1:
        raise ValueError(f"stage_index={stage_index} is outside 0..{len(boundaries) - 2}")
    return nn.Sequential(*layers[boundaries[stage_index] : boundaries[stage_index + 1]])


def stage_examples(layers: Sequence[nn.Module], boundaries: Sequence[int], stage_index: int,
                   inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage ``stage_index``'s input and output for the micro-batch ``inputs`` (the first stage's
    input), run without autograd through the layers up to the stage's end, the floating ones
    marked as needing gradients as they do in training: torch's static shape metadata for
    :class:`StageRunner` (see its ``example``)."""
    x = inputs
    with torch.no_grad():
        for layer in layers[: boundaries[stage_index]]:
            x = layer(x)
        start = x
        for layer in layers[boundaries[stage_index] : boundaries[stage_index + 1]]:
            x = layer(x)
    return start.detach().requires_grad_(start.is_floating_point()), x.detach().requires_grad_(x.is_floating_point())


class TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up its own forward and backward seconds in ``compute_s``."""

    compute_s: float = 0.0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started


class TokenLoss:
    """Per-micro-batch cross-entropy whose sum over a step's micro-batches is the step's mean
    over its real target tokens: each micro-batch sums its terms and divides by the whole
    step's count (set by :meth:`begin_step`), so micro-batches with more real tokens weigh
    more, exactly as in the unsplit model. Its seconds are counted in ``compute_s``.

    ``weight`` (from :meth:`begin_step`) scales that mean: a data-parallel replica's exact
    loss weight (:func:`poise.pipeline.replicas.replica_weight`); 1.0 alone.
    """

    def __init__(self) -> None:
        self.num_targets = 1
        self.weight = 1.0
        self.compute_s = 0.0

    def begin_step(self, targets: torch.Tensor, weight: float = 1.0) -> None:
        self.num_targets = max(1, int((targets != IGNORE_INDEX).sum()))
        self.weight = weight

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum") / self.num_targets
        if self.weight != 1.0:
            loss = loss * self.weight
        self.compute_s += time.perf_counter() - started
        return loss


@dataclass(frozen=True)
class StageStep:
    """One step on one stage.

    Attributes:
        loss: the step's loss (nats per real target token) on the last stage, else None;
            times the step's ``loss_weight``.
        compute_s: seconds of this stage's own forward/backward/loss in the step.
        step_s: wall seconds of the whole step (schedule, clipping, optimizer).
    """

    loss: float | None
    compute_s: float
    step_s: float


class StageRunner:
    """Run one stage of a pipeline, step after step.

    Args:
        module: this stage's layers (see :func:`stage_layers`), or those layers in DDP over
            the stage's data-parallel replicas (:class:`poise.pipeline.replicas.ReplicaSync`).
        stage_index: this stage, 0-based; stage k runs on rank k of ``group``.
        num_stages: stages in the pipeline (= ranks in ``group``).
        schedule: ``gpipe`` or ``1f1b``.
        num_micro_batches: micro-batches per step; a step's batch must hold at least as many samples.
        optimizer: updates ``module``'s parameters (None: gradients are left in place).
        grad_clip_norm: clip the global gradient norm (over every stage) to this; 0 = off.
        device: where this stage runs.
        group: the process group of the stages (default: the world); with data-parallel
            replicas, this replica's ``pp`` group (the norm is summed over it alone).
        example: this stage's input and output for one micro-batch (:func:`stage_examples`),
            given to torch as static shape metadata; None: torch infers them at the first step
            by running the stage. A DDP module needs them: torch's inference runs its forward
            outside ``no_sync``, which arms DDP's reducer, and the first step's micro-batch
            backwards then report every parameter ready once more (DDP's bucket rebuild fails
            an internal assert at the second step).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        stage_index: int,
        num_stages: int,
        schedule: str,
        num_micro_batches: int,
        optimizer: torch.optim.Optimizer | None,
        grad_clip_norm: float = 0.0,
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        example: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is unknown: allowed are {', '.join(SCHEDULES)}")
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
        self.module = module
        self.optimizer = optimizer
        self.grad_clip_norm = grad_clip_norm
        self.group = group
        self.num_micro_batches = num_micro_batches
        inputs, outputs = example if example is not None else (None, None)
        self.stage = TimedStage(module, stage_index, num_stages, device or torch.device("cpu"), group=group,
                                input_args=inputs, output_args=outputs)
        self.loss_fn = TokenLoss()
        # Sum, not mean, over micro-batches: TokenLoss already divides by the whole step's tokens.
        self.schedule = SCHEDULES[schedule](self.stage, num_micro_batches, loss_fn=self.loss_fn, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, loss_weight: float = 1.0) -> StageStep:
        """Run one training step; the first stage passes ``inputs``, the last ``targets`` (and
        ``loss_weight``, which scales its mean loss: see :class:`TokenLoss`)."""
        started = time.perf_counter()
        self.stage.compute_s = 0.0
        self.loss_fn.compute_s = 0.0
        args = (inputs,) if self.is_first else ()
        if self.is_first and (inputs is None or inputs.shape[0] < self.num_micro_batches):
            rows = None if inputs is None else inputs.shape[0]
            raise ValueError(f"a batch of {rows} samples cannot be cut into {self.num_micro_batches} micro-batches")
        losses: list[torch.Tensor] = []
        if self.is_last:
            assert targets is not None, "the last stage needs the targets"
            self.loss_fn.begin_step(targets, loss_weight)
            self.schedule.step(*args, target=targets, losses=losses)
        else:
            self.schedule.step(*args)
        if self.optimizer is not None:
            if self.grad_clip_norm > 0:
                clip_global_grad_norm(list(self.module.parameters()), self.grad_clip_norm, self.group)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss = float(sum(float(x.detach()) for x in losses)) if self.is_last else None
        compute = self.stage.compute_s + self.loss_fn.compute_s
        return StageStep(loss, compute, time.perf_counter() - started)


    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
                 loss_weight: float = 1.0) -> float | None:
        """Forward only (torch's ``schedule.eval``): the last stage's loss as in :meth:`step`,
        None elsewhere; no gradient, no optimizer step."""
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] = []
        if self.is_last:
            assert targets is not None, "the last stage needs the targets"
            self.loss_fn.begin_step(targets, loss_weight)
            self.schedule.eval(*args, target=targets, losses=losses)
            return float(sum(float(x.detach()) for x in losses))
        self.schedule.eval(*args)
        return None


def clip_global_grad_norm(params: Sequence[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None) -> float:
    """Clip gradients so the norm over every stage's gradients is at most ``max_norm``.

    Each stage holds part of the model, so the squared norms are summed across the stages
    (one all-reduce of a scalar) before scaling, as clipping the unsplit model would.
    Returns the global norm before clipping.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.stack([g.detach().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    total = local.to(torch.float64)
    dist.all_reduce(total, group=group)
    norm = math.sqrt(float(total))
    coef = max_norm / (norm + 1e-6)  # the same factor torch.nn.utils.clip_grad_norm_ applies
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm
