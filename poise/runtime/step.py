"""One training step, timed phase by phase: the only place that knows the order of a step.

data → forward → backward (DDP's hook fires per bucket; the probe notes when this rank's
last bucket was ready; the hook compresses and reduces) → clip → optimizer → scheduler.
Returns a :class:`~poise.diagnostics.timeline.StepRecord`.

With gradient accumulation a call is one micro-batch of an accumulation window: the loss is
divided by the window's length, and every micro-batch but the window's last runs forward and
backward under DDP's ``no_sync``, so gradients add up locally and nothing is communicated;
the last one's backward reduces the sum, and only it clips and steps the optimizer.

A step whose reduced gradients are not finite (a NaN/Inf a codec let through with
``comm.on_nonfinite='skip'``) skips the optimizer: the same on every rank, since every rank
holds the same reduced gradient.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence

import torch
from torch import nn

from poise.comm.probe import BucketProbe
from poise.comm.state import CommState
from poise.diagnostics.timeline import StepRecord
from poise.runtime.slowdown import Slowdown
from poise.tasks.base import Task

log = logging.getLogger(__name__)


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
    comm_state: CommState,
    slowdown: Slowdown,
    grad_clip_norm: float,
    device: torch.device,
    accum_steps: int = 1,
    last_micro: bool = True,
) -> StepRecord:
    """Run one step on this rank's samples ``indices`` and return its timings (seconds) and counts.

    ``loss_scale`` multiplies the loss before backward, so that DDP's average of the ranks'
    gradients weights each rank by its share of the step's loss terms (runtime/data.py).
    ``comm_state`` is the comm hook's state (``reset_step()``, ``step_stats()``).
    ``accum_steps`` > 1: this is one micro-batch; ``last_micro`` says whether it ends its
    accumulation window (see module doc).
    """
    wall_start = time.time()
    t0 = time.perf_counter()
    batch = task.collate([task.train_set[int(i)] for i in indices]).to(device)
    t1 = time.perf_counter()

    probe.reset()
    comm_state.reset_step()
    slowdown.mark_s = t1
    # DDP's no_sync must cover the forward too: it arms (or not) the reduction there.
    no_sync = getattr(model, "no_sync", None)
    local_only = no_sync() if not last_micro and no_sync is not None else contextlib.nullcontext()
    with local_only:
        loss = task.train_loss(model, batch)
        _sync(device)
        slowdown.stretch()  # emulated slowness counts as this rank's compute (no-op normally)
        t2 = time.perf_counter()
        (loss * (loss_scale / accum_steps)).backward()
        _sync(device)
    t3 = time.perf_counter()
    # No bucket reached the hook only if nothing needs a gradient; then there was no comm.
    ready = probe.last_ready if probe.last_ready is not None else t3
    comm_busy_s, comm_hidden_s = probe.comm_overlap(ready)

    skipped = False
    if last_micro:
        # The total norm is needed anyway for clipping; it also tells whether the gradient is finite.
        norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm if grad_clip_norm > 0 else math.inf)
        skipped = not math.isfinite(float(norm))
        if skipped:
            log.warning("step %d: gradient norm is %s: optimizer step skipped", step, float(norm))
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    loss_value = float(loss.detach())  # synchronises on CUDA; the step is over anyway
    t4 = time.perf_counter()
    stats = comm_state.step_stats()
    inter_node = comm_state.inter_node_stats()

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
        raw_bytes=stats.raw_bytes,
        wire_bytes=stats.wire_bytes,
        inter_node_raw_bytes=inter_node.raw_bytes,
        inter_node_wire_bytes=inter_node.wire_bytes,
        codec_s=stats.encode_s + stats.decode_s,
        comm_busy_s=comm_busy_s,
        comm_hidden_s=comm_hidden_s,
        skipped=int(skipped),
    )
