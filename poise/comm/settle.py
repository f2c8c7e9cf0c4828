"""The resume workaround: make DDP settle its bucket layout before a restored state is used.

Why it is needed: DDP starts with buckets in reverse parameter order and, at the first
forward after a synchronised backward, rebuilds them in the order gradients became ready.
Per-bucket state (error-feedback residuals, PowerSGD's warm starts, random-k's counters) is
keyed by bucket index, and a checkpoint holds it in the rebuilt layout. A resumed job starts
with the initial layout again, so its first compressed step would apply every residual to the
wrong entries. :func:`settle_buckets` runs one throw-away step with the hook bypassed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from poise.comm.state import CommState


def settle_buckets(ddp: torch.nn.parallel.DistributedDataParallel, state: CommState,
                   forward_backward: Callable[[], None]) -> None:
    """Make DDP settle its bucket layout now, without changing any state; call on every rank.

    One throw-away ``forward_backward`` with the hook bypassed (``state.bypassed()``: plain
    all-reduce, no step counted, no residual touched) lets DDP record the order; the first
    real step then runs on the layout the checkpoint was written with. Gradients are cleared
    and the counters zeroed afterwards, so call it before restoring any gradient.
    """
    with state.bypassed():
        forward_backward()
    ddp.zero_grad(set_to_none=True)
    state.reset_step()
