"""One training step, timed phase by phase: the only place that knows the order of a step.

data → forward → backward (DDP's hook fires per bucket; the probe notes when this rank's
last bucket was ready) → clip → optimizer → scheduler. Returns a
:class:`~poise.diagnostics.timeline.StepRecord`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from poise.comm.hooks import BucketProbe
from poise.diagnostics.timeline import StepRecord
from poise.runtime.slowdown import Slowdown
from poise.tasks.base import Task


def _sync(device: torch.device) -> None:
    # CPU/GPU synchronisation point: only on CUDA, where kernels run asynchronously.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(
    *,
    step: int,
    model: nn.Module,
    task: Task,
    indices: Sequence[int],
    loss_scale: float,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    probe: BucketProbe,
    slowdown: Slowdown,
    grad_clip_norm: float,
    device: torch.device,
) -> StepRecord:
    """Run one step on this rank's samples ``indices`` and return its timings (seconds) and counts.

    ``loss_scale`` multiplies the loss before backward, so that DDP's average of the ranks'
    gradients weights each rank by its share of the step's loss terms (runtime/data.py).
    """
    wall_start = time.time()
    t0 = time.perf_counter()
    batch = task.collate([task.train_set[int(i)] for i in indices]).to(device)
    t1 = time.perf_counter()

    probe.reset()
    slowdown.mark_s = t1
    loss = task.train_loss(model, batch)
    _sync(device)
    slowdown.stretch()  # emulated slowness counts as this rank's compute (no-op normally)
    t2 = time.perf_counter()
    (loss * loss_scale).backward()
    _sync(device)
    t3 = time.perf_counter()
    # No bucket reached the hook only if nothing needs a gradient; then there was no comm.
    ready = probe.last_ready_s if probe.last_ready_s is not None else t3

    if grad_clip_norm > 0:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    loss_value = float(loss.detach())  # synchronises on CUDA; the step is over anyway
    t4 = time.perf_counter()

    return StepRecord(
        step=step,
        start_time_s=wall_start,
        data_s=t1 - t0,
        forward_s=t2 - t1,
        backward_s=ready - t2,
        comm_wait_s=t3 - ready,
        optim_s=t4 - t3,
        step_s=t4 - t0,
        samples=batch.num_samples,
        tokens=batch.num_tokens,
        padded_tokens=batch.num_padded_tokens,
        loss=loss_value,
        comm_bytes=probe.bytes_this_step,
    )
