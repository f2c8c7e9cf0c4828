"""The DDP communication-hook adapter, and the probe that times a rank's own compute.

DDP hands each gradient bucket to a communication hook as soon as the bucket's gradients
are ready, then waits for every hook's future at the end of ``backward()``. That gives a
clean way to split backward time on each rank without extra synchronisation:

- the moment the *last* bucket reaches its hook is when this rank finished computing its
  gradients (its own compute, whatever its speed);
- the time from then until ``backward()`` returns is time blocked in communication,
  which includes waiting for slower ranks to send their share.

Timing the whole ``backward()`` instead would hide a slow rank: DDP's all-reduce makes every
rank's backward last as long as the slowest one's. :class:`BucketProbe` records the
readiness times and bytes; :func:`instrumented` wraps any hook with it, so compression hooks
added later are measured the same way.
"""

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class BucketProbe:
    """Per-step record of when buckets became ready and how many bytes they carried.

    Attributes:
        last_ready_s: ``time.perf_counter()`` (seconds) when the last bucket reached the hook
            this step, or None before any did.
        bytes_this_step: gradient bytes handed to communication this step, per rank.
        buckets_this_step: number of buckets seen this step.
    """

    def __init__(self, synchronize_cuda: bool = False) -> None:
        self.synchronize_cuda = synchronize_cuda
        self.reset()

    def reset(self) -> None:
        """Start a new step."""
        self.last_ready_s: float | None = None
        self.bytes_this_step = 0
        self.buckets_this_step = 0

    def on_bucket(self, buffer: torch.Tensor) -> None:
        if self.synchronize_cuda:
            # CUDA kernels run asynchronously: wait for the gradients to exist, or the time
            # would only say when they were queued. Costs some overlap; buys honest numbers.
            torch.cuda.synchronize(buffer.device)
        self.last_ready_s = time.perf_counter()
        self.bytes_this_step += buffer.numel() * buffer.element_size()
        self.buckets_this_step += 1


def instrumented(hook: CommHook, probe: BucketProbe) -> CommHook:
    """Wrap a DDP comm hook so ``probe`` sees every bucket before ``hook`` sends it.

    (DDP checks the wrapper's annotations at registration, so this module must not use
    postponed, string annotations.)
    """

    def timed_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        probe.on_bucket(bucket.buffer())
        return hook(state, bucket)

    return timed_hook


def allreduce_hook() -> CommHook:
    """The baseline: torch's own averaging all-reduce hook (what DDP does with no hook)."""
    return default_hooks.allreduce_hook
