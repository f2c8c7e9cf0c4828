"""What every poise batch sampler is: an epoch of planned steps and this rank's position in it.

Both samplers (:class:`~poise.balance.static_schedule.StaticSchedule`, the baseline, and
:class:`~poise.balance.sampler.BalancedBatchSampler`) are torch batch samplers
(``DataLoader(batch_sampler=...)`` yields this rank's lists of sample indices) with
``set_epoch``, ``len`` (steps in the epoch, equal on every rank), ``state_dict``/
``load_state_dict`` (the position to checkpoint), and one more method the runtime uses:
``global_batches(step)``, every rank's indices for a step. Each rank can compute it without
communicating, which is how a rank knows its share of the step's loss terms (for exact
gradient weighting) and how all ranks agree on the number of steps.

A DataLoader takes batches from its sampler ahead of the loop (``num_workers`` > 0 prefetches
several), so the sampler's ``position`` runs ahead of the step being trained. Each sampler
therefore keeps ``handed``: the ``(epoch, step, time)`` of every batch it gave out and nobody has
claimed yet, in order. :class:`poise.Session` claims one per training step, which is how it
knows which step of the plan the batch in hand belongs to.

``set_epoch(e)`` right after ``load_state_dict`` of a state saved inside epoch ``e`` keeps the
loaded position, so the usual ``for epoch in range(start, epochs): sampler.set_epoch(epoch)``
loop resumes mid-epoch instead of starting the epoch over.

Resuming on another number of ranks (an elastic restart): ``load_state_dict`` of a state
saved with a different ``world_size`` rebuilds the saved plan, takes the samples its epoch
had not reached yet (:meth:`EpochSampler.remaining_samples`) and plans only those over the new ranks
(``set_epoch(epoch, remaining=...)``), so the epoch still trains on every sample once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

# more batches than any DataLoader prefetches, none claimed: the sampler runs without a session
_UNCLAIMED_WARNING = 256
log = logging.getLogger(__name__)


class EpochSampler(ABC):
    """What both samplers share: an epoch of planned steps and this rank's position in it."""

    rank: int
    epoch: int
    position: int
    _steps: Sequence[Any]
    # (epoch, step, perf_counter seconds when handed) of batches given out and not yet claimed, oldest first
    handed: deque[tuple[int, int, float]]
    _keep_epoch: int | None = None  # set by load_state_dict: the next set_epoch(that epoch) keeps the position

    def __len__(self) -> int:
        """Steps in the current epoch (the same on every rank)."""
        return len(self._steps)

    @abstractmethod
    def global_batches(self, step: int) -> list[np.ndarray]:
        """Every rank's sample indices for ``step`` of the current epoch."""

    @abstractmethod
    def remaining_samples(self) -> np.ndarray:
        """Sample indices of the current epoch's steps from ``position`` on (not trained on yet)."""

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches from the current position to the end of the epoch."""
        self.handed.clear()  # a new pass: batches prefetched by an abandoned one never reach the loop
        while self.position < len(self):
            step = self.position
            batch = self.global_batches(step)[self.rank]
            self.position += 1
            self.handed.append((self.epoch, step, time.perf_counter()))
            if len(self.handed) == _UNCLAIMED_WARNING:
                log.warning("%s: %d batches handed out and none trained through poise.Session: ranks' batches "
                            "differ, so each rank's mean loss must be weighted by poise.balance.loss_weight("
                            "sampler.global_batches(step), rank, loss_terms) for an unbiased gradient "
                            "(poise.Session does it)", type(self).__name__, _UNCLAIMED_WARNING)
            yield batch.tolist()

    def steps_in_epochs(self, num_epochs: int) -> int:
        """Steps of epochs ``0 .. num_epochs - 1`` as planned now (a re-fitted cost function can
        change later epochs a little); plans each of them, so call it before training: it
        leaves the sampler at the start of epoch 0."""
        total = 0
        for epoch in range(num_epochs):
            self.set_epoch(epoch)
            total += len(self)
        self.set_epoch(0)
        return total

    def _begin_epoch(self, epoch: int, remaining: np.ndarray | None) -> bool:
        """Common start of ``set_epoch``; False when the position loaded for ``epoch`` is kept."""
        if remaining is None and self._keep_epoch is not None and epoch == self._keep_epoch:
            self._keep_epoch = None
            return False
        self._keep_epoch = None
        self.epoch, self.position = epoch, 0
        self.handed = deque()
        return True
