"""``deadline+stale``: a rank that computed nothing in a step sends its previous gradient.

Biased (the gradient belongs to older weights and to samples already trained) and off by
default; bounded by ``straggler.max_staleness`` steps. A wrapper around any comm hook: in a
normal step it keeps a copy of each bucket as this rank hands it over (its own accumulated,
weighted gradient, before any codec); in a replay step it puts that copy, rescaled, in the
bucket instead. The codec, error feedback and collective below see an ordinary bucket.

(DDP checks the wrapper's annotations at registration: no postponed annotations here.)
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class StaleStash:
    """The last gradient this rank sent, per bucket, and what it stood for.

    ``terms``: the loss terms behind it; ``reference``: the loss-term total its weight was
    divided by; ``step``: the step it was computed in.
    """

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.buffers: dict[int, torch.Tensor] = {}
        self.terms, self.reference, self.step = 0.0, 1.0, -math.inf
        self.replay: float | None = None  # while replaying: the factor the copy is multiplied by

    def usable(self, step: int) -> bool:
        """Whether the stash may stand in for step ``step``'s gradient."""
        return self.terms > 0 and 0 < step - self.step <= self.max_staleness

    def begin_replay(self, reference: float) -> float:
        """Replay in this step (whose weights divide by ``reference``); returns the terms it carries."""
        self.replay = self.reference / reference
        return self.terms

    def kept(self, step: int, terms: float, reference: float) -> None:
        """A normal step handed its buckets over: they are the stash now (or, after a replay, not)."""
        if self.replay is not None:
            self.replay = None
            return
        self.terms, self.reference, self.step = terms, reference, step

    def wrap(self, hook: Hook) -> Hook:
        def stale_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer, index = bucket.buffer(), bucket.index()
            kept = self.buffers.get(index)
            if self.replay is not None:
                if kept is not None and kept.shape == buffer.shape:
                    buffer.copy_(kept).mul_(self.replay)
                else:
                    buffer.zero_()  # DDP rebuilt its buckets since: nothing to replay for this one
            elif kept is None or kept.shape != buffer.shape:
                self.buffers[index] = buffer.detach().clone()
            else:
                kept.copy_(buffer)
            return hook(state, bucket)

        return stale_hook


__all__ = ["StaleStash"]
