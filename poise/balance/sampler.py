"""Which samples each rank trains on, step by step: the baseline data split.

The baseline is torch's own ``DistributedSampler`` (shuffle by seed and epoch, equal-size
shares, ``drop_last``), cut into batches either of a fixed number of samples or up to a
per-rank token budget (padded tokens counted, since padding costs compute too).

The schedule is plain data computed identically on every rank with no communication: each
rank can derive every other rank's batches, which is how all ranks agree on how many steps an
epoch has when token budgets give ranks different batch counts (the shortest wins, so no rank
waits forever in a collective; what is cut is logged). Later strategies (cost- and
speed-aware sharding) plug in here behind the same :class:`BatchSchedule` interface.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
from torch.utils.data import DistributedSampler

log = logging.getLogger(__name__)


def rank_batches(
    lengths: np.ndarray,
    *,
    rank: int,
    world_size: int,
    epoch: int,
    seed: int,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
) -> list[list[int]]:
    """One rank's batches for one epoch, in order.

    Args:
        lengths: tokens per sample (the cost metadata), one entry per training sample.
        batch_size: samples per batch; incomplete last batch dropped.
        batch_tokens: instead of ``batch_size``, a budget of padded tokens per batch
            (``max length in batch × samples``); a sample longer than the budget gets a
            batch of its own.

    Returns:
        Lists of dataset indices.
    """
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError("give exactly one of batch_size and batch_tokens")
    sampler = DistributedSampler(
        range(len(lengths)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    order = list(sampler)
    if batch_size is not None:
        return [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for idx in order:
        n = int(lengths[idx])
        if current and max(longest, n) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(idx)
        longest = max(longest, n)
    return batches  # the last, partial batch is dropped like DistributedSampler's tail


class BatchSchedule:
    """This rank's batches over epochs, with every rank running the same number of steps.

    Iterating yields lists of dataset indices (use it as a DataLoader ``batch_sampler``).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        rank: int,
        world_size: int,
        seed: int,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
    ) -> None:
        self.lengths = np.asarray(lengths)
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        if self.steps_in_epoch(0) == 0:
            raise ValueError(
                f"the training split ({len(self.lengths)} samples) is too small for "
                f"{world_size} ranks with batch_size={batch_size} batch_tokens={batch_tokens}"
            )

    def _batches(self, rank: int, epoch: int) -> list[list[int]]:
        return rank_batches(
            self.lengths,
            rank=rank,
            world_size=self.world_size,
            epoch=epoch,
            seed=self.seed,
            batch_size=self.batch_size,
            batch_tokens=self.batch_tokens,
        )

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps every rank runs in ``epoch``: the fewest batches any rank has."""
        if self.batch_size is not None:  # equal shares, equal batch counts: no need to look
            return len(self.lengths) // self.world_size // self.batch_size
        return min(len(self._batches(r, epoch)) for r in range(self.world_size))

    def epoch(self, epoch: int) -> list[list[int]]:
        """This rank's batches for ``epoch``, cut to the common step count."""
        batches = self._batches(self.rank, epoch)
        steps = self.steps_in_epoch(epoch)
        if len(batches) > steps:
            log.debug("epoch %d: rank %d drops %d batches to match other ranks", epoch, self.rank, len(batches) - steps)
        return batches[:steps]

    def iter_steps(self, num_steps: int | None = None, num_epochs: int | None = None) -> Iterator[list[int]]:
        """Batches for ``num_steps`` steps (cycling epochs) or for ``num_epochs`` whole epochs."""
        produced, epoch = 0, 0
        while True:
            if num_epochs is not None and epoch >= num_epochs:
                return
            for batch in self.epoch(epoch):
                if num_steps is not None and produced >= num_steps:
                    return
                yield batch
                produced += 1
            epoch += 1

    def total_steps(self, num_steps: int | None = None, num_epochs: int | None = None) -> int:
        """How many steps :meth:`iter_steps` will yield."""
        if num_steps is not None:
            return num_steps
        assert num_epochs is not None
        return sum(self.steps_in_epoch(e) for e in range(num_epochs))
