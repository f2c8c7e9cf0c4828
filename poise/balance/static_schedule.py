"""The baseline batch sampler: torch's ``DistributedSampler`` shares cut into batches.

:class:`StaticSchedule` gives every rank equal sample counts, shuffled by seed and epoch
(``drop_last``), cut into fixed-size batches, or into per-rank token budgets where the
shortest rank sets the epoch's step count. What it shares with the balanced sampler (the
batch sampler interface, batches handed out and not yet claimed, resuming mid-epoch and on
another number of ranks) is :class:`~poise.balance.epoch_sampler.EpochSampler`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from poise.balance.epoch_sampler import EpochSampler


class StaticSchedule(EpochSampler):
    """The baseline: ``DistributedSampler`` shares cut into batches (see module doc).

    Args:
        lengths: tokens per sample (only used with ``batch_tokens``).
        batch_size: samples per rank per step; the incomplete last batch is dropped.
        batch_tokens: instead, padded tokens per rank per step (``max length × samples``).
    """

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
    ) -> None:
        if (batch_size is None) == (batch_tokens is None):
            raise ValueError("give exactly one of batch_size and batch_tokens")
        self.lengths = np.asarray(lengths)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.epoch, self.position = 0, 0
        self.remaining: np.ndarray | None = None
        self._steps: list[list[np.ndarray]] = []
        self.set_epoch(0)
        if not self._steps:
            raise ValueError(
                f"the training split ({len(self.lengths)} samples) is too small for {world_size} ranks "
                f"with batch_size={batch_size} batch_tokens={batch_tokens}"
            )

    def _rank_batches(self, rank: int) -> list[np.ndarray]:
        sampler = DistributedSampler(
            range(len(self.lengths)), num_replicas=self.world_size, rank=rank, shuffle=True, seed=self.seed,
            drop_last=True,
        )
        sampler.set_epoch(self.epoch)
        order = np.fromiter(iter(sampler), dtype=np.int64)
        if self.batch_size is not None:
            n = len(order) // self.batch_size
            return list(order[: n * self.batch_size].reshape(n, self.batch_size))
        assert self.batch_tokens is not None
        batches: list[np.ndarray] = []
        start, longest = 0, 0
        for k, idx in enumerate(order):
            length = int(self.lengths[idx])
            if k > start and max(longest, length) * (k - start + 1) > self.batch_tokens:
                batches.append(order[start:k])
                start, longest = k, 0
            longest = max(longest, length)
        return batches  # the last, partial batch is dropped like DistributedSampler's tail

    def _deal(self, remaining: np.ndarray) -> list[list[np.ndarray]]:
        """Steps over ``remaining`` only (in its order): samples dealt to ranks in turn, a step
        closing when the next rank's batch is full. Nothing is dropped: a last step too small
        to give every rank a sample joins the step before it."""
        steps: list[list[np.ndarray]] = []
        current: list[list[int]] = [[] for _ in range(self.world_size)]
        k = 0
        for idx in remaining.tolist():
            r = k % self.world_size
            batch = current[r]
            if self.batch_size is not None:
                full = len(batch) >= self.batch_size
            else:
                assert self.batch_tokens is not None
                longest = max([int(self.lengths[i]) for i in batch] + [int(self.lengths[idx])])
                full = bool(batch) and longest * (len(batch) + 1) > self.batch_tokens
            if full and k >= self.world_size:
                steps.append([np.asarray(b, dtype=np.int64) for b in current])
                current, k, r = [[] for _ in range(self.world_size)], 0, 0
            current[r].append(idx)
            k += 1
        if k >= self.world_size:
            steps.append([np.asarray(b, dtype=np.int64) for b in current])
        elif k and steps:
            for j, idx in enumerate(i for b in current for i in b):
                last = steps[-1][j % self.world_size]
                steps[-1][j % self.world_size] = np.append(last, idx)
        elif k:
            raise ValueError(f"{k} samples left in the epoch cannot give each of {self.world_size} ranks one")
        return steps

    def set_epoch(self, epoch: int, remaining: np.ndarray | None = None) -> None:
        """Plan ``epoch``: every rank's batches, cut to the count of the rank with fewest.

        With ``remaining``, plan only those samples (the rest of an epoch resumed on another
        number of ranks) and drop none of them.
        """
        if not self._begin_epoch(epoch, remaining):
            return
        self.remaining = None if remaining is None else np.asarray(remaining, dtype=np.int64)
        if self.remaining is not None:
            self._steps = self._deal(self.remaining)
            return
        per_rank = [self._rank_batches(r) for r in range(self.world_size)]
        steps = min(len(b) for b in per_rank)
        self._steps = [[per_rank[r][i] for r in range(self.world_size)] for i in range(steps)]

    def steps_in_epochs(self, num_epochs: int) -> int:
        """Steps of epochs ``0 .. num_epochs - 1``. With ``batch_size`` every epoch has the same
        count (``DistributedSampler``'s equal share, cut into whole batches), so it is computed,
        not planned epoch by epoch: with each epoch planned, a job of 100,000 epochs (a soak that
        trains until stopped) spent 14 s here at every start and restart."""
        if self.batch_size is None:
            return super().steps_in_epochs(num_epochs)
        per_rank = len(self.lengths) // self.world_size  # DistributedSampler with drop_last
        return num_epochs * (per_rank // self.batch_size)

    def global_batches(self, step: int) -> list[np.ndarray]:
        """Every rank's sample indices for ``step`` of the current epoch."""
        return self._steps[step]

    def remaining_samples(self) -> np.ndarray:
        rest = [b for step in self._steps[self.position :] for b in step]
        return np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Where the epoch stands; ``position``: the step to resume at (default: the next one
        not handed out; a loop that has not trained on every handed batch passes its own)."""
        position = self.position if position is None else position
        return {"epoch": self.epoch, "position": position, "world_size": self.world_size,
                "remaining": None if self.remaining is None else self.remaining.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped; on another number of ranks, re-plan the epoch's rest."""
        self._keep_epoch = None
        saved_world = int(state.get("world_size", self.world_size))
        if saved_world != self.world_size:
            saved = StaticSchedule(self.lengths, rank=0, world_size=saved_world, seed=self.seed,
                                   batch_size=self.batch_size, batch_tokens=self.batch_tokens)
            saved.load_state_dict(state)
            self.set_epoch(saved.epoch, remaining=saved.remaining_samples())
        else:
            self.set_epoch(int(state["epoch"]), state.get("remaining"))
            self.position = int(state["position"])
        self._keep_epoch = self.epoch
