"""The deadline plan of one step: pure functions, the same on every rank.

A step of straggler-tolerant aggregation is a queue of micro-batches per rank: its share of
the step's batch (the sampler's plan, cut into micro-batches), then its share of the
**pool**, the samples earlier steps did not reach. Every rank computes micro-batches from
the front of its queue until the next one would end after the shared deadline, then enters
the all-reduce. The all-reduce also carries how many micro-batches each rank computed
(``k``), so every rank can work out the same new pool: what was not reached goes back into
it, nothing is dropped, and a rank that is fast this step takes pooled work off the slow
ones. At the epoch's end the pool is trained in steps of its own (:func:`catch_up`), so
every sample of the epoch is trained exactly once.

All inputs are plain arrays; cost is ``O(samples in the step + pool)`` per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Queues:
    """Every rank's micro-batches for one step, in the order they are computed.

    ``planned[r]``: how many of rank r's micro-batches come from the step's own batch (the rest
    come from the pool). ``from_pool``: the pool's sample indices handed out, in pool order.
    """

    micro: list[list[np.ndarray]]
    planned: list[int]

    def computed(self, k: np.ndarray) -> np.ndarray:
        """Sample indices trained when rank r computed its first ``k[r]`` micro-batches."""
        done = [m for r, queue in enumerate(self.micro) for m in queue[: int(k[r])]]
        return np.concatenate(done) if done else np.zeros(0, dtype=np.int64)


def split_micro(indices: np.ndarray, micro_batches: int) -> list[np.ndarray]:
    """``indices`` in ``micro_batches`` contiguous parts of near-equal size (fewer when there
    are fewer samples; none for none)."""
    n = min(micro_batches, len(indices))
    return [np.asarray(part, dtype=np.int64) for part in np.array_split(np.asarray(indices), n)] if n else []


def build_queues(batches: list[np.ndarray], pool: np.ndarray, micro_batches: int, micro_samples: int) -> Queues:
    """Each rank's queue: its batch of the step in ``micro_batches`` parts, then the pool in
    chunks of ``micro_samples`` dealt round-robin over the ranks (chunk i to rank i mod W)."""
    world = len(batches)
    micro = [split_micro(b, micro_batches) for b in batches]
    planned = [len(q) for q in micro]
    size = max(1, micro_samples)
    for i, start in enumerate(range(0, len(pool), size)):
        micro[i % world].append(np.asarray(pool[start:start + size], dtype=np.int64))
    return Queues(micro, planned)


def pool_after(queues: Queues, pool: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The pool once rank r has computed its first ``k[r]`` micro-batches: the old pool less
    what was trained from it (its order kept: the oldest deferrals go first), then the step's
    own samples nobody reached, in rank order."""
    done = queues.computed(k)
    keep = pool[~np.isin(pool, done)] if len(pool) else pool
    missed = [m for r, queue in enumerate(queues.micro) for m in queue[int(k[r]): queues.planned[r]]]
    return np.concatenate([keep.astype(np.int64), *missed]) if missed else keep.astype(np.int64)


def catch_up(pool: np.ndarray, world: int, micro_batches: int, micro_samples: int
             ) -> tuple[list[np.ndarray], np.ndarray]:
    """The next step of the epoch's tail, when only the pool is left: ``(batches, rest)``,
    the pool's first ``world × micro_batches × micro_samples`` samples dealt over the ranks as
    the step's planned batches, and the rest of the pool (handed out as extra work after them)."""
    n = world * micro_batches * max(1, micro_samples)
    take = pool[:n]
    return [take[r::world] for r in range(world)], pool[n:]


def deadline_s(rates: np.ndarray, costs: np.ndarray, slack: float) -> float | None:
    """The step's deadline in seconds after its start: ``(1 + slack)`` × the median over ranks
    of the predicted time of their planned work (rate s/cost × cost). The median, not the
    maximum: a rank predicted slower than most is not waited for, its rest goes to the pool.
    None (no deadline: wait for everyone) while a rank with work has no prediction yet."""
    busy = costs > 0
    if not busy.any() or not np.all(np.isfinite(rates[busy])):
        return None
    return float((1.0 + slack) * np.median(rates[busy] * costs[busy]))


__all__ = ["Queues", "build_queues", "catch_up", "deadline_s", "pool_after", "split_micro"]
