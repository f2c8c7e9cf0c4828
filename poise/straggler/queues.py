"""The queues of one deadline step: pure functions, the same on every rank.

A step of straggler-tolerant aggregation is a set of **lists** of micro-batches: list ``r``
(``r < W``) is rank r's share of the step's batch (the sampler's plan, cut into
micro-batches); list ``W`` is the **pool**, the samples earlier steps did not reach, in
chunks. A rank computes its own list first, then the pool, then what is left of the other
ranks' lists, taking one micro-batch at a time from the front of a list with an atomic claim
(:mod:`poise.straggler.claims`), until nothing is left or the next one would end after the
shared deadline. So the front ``taken[q]`` micro-batches of each list q are exactly the ones
computed, whoever computed them; the all-reduce at the step's end carries ``taken``, and
every rank works out the same new pool from it: what was not reached goes back, nothing is
dropped. At the epoch's end the pool is trained in steps of its own (:func:`catch_up`), so
every sample of the epoch is trained exactly once.

All inputs are plain arrays; cost is ``O(samples in the step + pool)`` per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Queues:
    """Every list of one step's micro-batches (see module doc), each in the order it is taken.

    ``micro[r]`` for ``r < W``: rank r's share of the step's batch; ``micro[W]``: the pool in
    chunks, shared by every rank.
    """

    micro: list[list[np.ndarray]]

    @property
    def world(self) -> int:
        return len(self.micro) - 1

    @property
    def planned(self) -> list[int]:
        """Micro-batches of each rank's share of the step's batch."""
        return [len(q) for q in self.micro[:-1]]

    def order(self, rank: int) -> list[int]:
        """The lists in the order ``rank`` takes from them: its own, the pool, then the other
        ranks' from its right-hand neighbour on (so thieves spread over the slow ranks)."""
        w = self.world
        return [rank, w, *((rank + i) % w for i in range(1, w))]

    def computed(self, taken: np.ndarray) -> np.ndarray:
        """Sample indices trained when the front ``taken[q]`` micro-batches of list q were."""
        done = [m for q, lst in enumerate(self.micro) for m in lst[: int(taken[q])]]
        return np.concatenate(done) if done else np.zeros(0, dtype=np.int64)


def split_micro(indices: np.ndarray, micro_batches: int) -> list[np.ndarray]:
    """``indices`` in ``micro_batches`` contiguous parts of near-equal size (fewer when there
    are fewer samples; none for none)."""
    n = min(micro_batches, len(indices))
    return [np.asarray(part, dtype=np.int64) for part in np.array_split(np.asarray(indices), n)] if n else []


def build_queues(batches: list[np.ndarray], pool: np.ndarray, micro_batches: int, micro_samples: int) -> Queues:
    """The step's lists: each rank's batch in ``micro_batches`` parts, then the pool in
    chunks of ``micro_samples`` (oldest first)."""
    size = max(1, micro_samples)
    pooled = [np.asarray(pool[s:s + size], dtype=np.int64) for s in range(0, len(pool), size)]
    return Queues([*(split_micro(b, micro_batches) for b in batches), pooled])


def pool_after(queues: Queues, taken: np.ndarray) -> np.ndarray:
    """The pool once the front ``taken[q]`` micro-batches of each list were computed: the old
    pool's rest (its order kept: the oldest deferrals go first), then the step's own samples
    nobody reached, in rank order."""
    w = queues.world
    pooled = queues.micro[w][int(taken[w]):]
    missed = [m for lst, t in zip(queues.micro[:w], taken[:w], strict=True) for m in lst[int(t):]]
    rest = [*pooled, *missed]
    return np.concatenate(rest).astype(np.int64) if rest else np.zeros(0, dtype=np.int64)


def catch_up(pool: np.ndarray, world: int, micro_batches: int, micro_samples: int
             ) -> tuple[list[np.ndarray], np.ndarray]:
    """The next step of the epoch's tail, when only the pool is left: ``(batches, rest)``,
    the pool's first ``world × micro_batches × micro_samples`` samples dealt over the ranks as
    the step's planned batches, and the rest of the pool (the step's pool list)."""
    n = world * micro_batches * max(1, micro_samples)
    take = pool[:n]
    return [take[r::world] for r in range(world)], pool[n:]


def deadline_s(rates: np.ndarray, costs: np.ndarray, slack: float) -> float | None:
    """The step's deadline in seconds after its start: ``(1 + slack)`` × the median over ranks
    of the predicted time of their planned work (rate s/cost × cost). The median, not the
    maximum: a rank predicted slower than most is not waited for, the others take its rest.
    Ranks with no prediction yet (a slow rank whose work the others took has few micro-batches
    to learn from) do not count, once more than half of the ranks with work have one; before
    that, None (no deadline: wait for everyone)."""
    busy = costs > 0
    known = busy & np.isfinite(rates)
    if not busy.any() or 2 * int(known.sum()) <= int(busy.sum()):
        return None
    return float((1.0 + slack) * np.median(rates[known] * costs[known]))


__all__ = ["Queues", "build_queues", "catch_up", "deadline_s", "pool_after", "split_micro"]
