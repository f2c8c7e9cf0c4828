"""The batch sampler of packed rows: :class:`PackedBatchSampler`, over the pieces of documents.

Its steps are the naive packer's (:func:`~poise.balance.packing.packed_steps`: documents in a
seeded order, rows filled in order, ``rows_per_rank × world_size`` rows to a step); each
step is split by :func:`~poise.balance.packing.split_packed` (cost and speed; balance
``auto``, ``cost`` and ``dynamic``) or :func:`~poise.balance.packing.split_naive` (equal runs
of rows; ``static``). Both train the same pieces in every step, so they differ only in who
computes what. A rank's batch is its pieces row by row: a collate that fills rows in order
rebuilds the planned rows (:func:`~poise.balance.packing.rows_in_order`).

What it shares with the balanced sampler (steps taken in order with the speeds of the moment,
speeds and a cost function a re-planner updates, state that resumes mid-epoch and on another
number of ranks) is :class:`~poise.balance.sampler.BalancedBatchSampler`'s; its ``lengths``
are the pieces' (what a step's loss weight and measurements count).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np

from poise.balance.costs import AttentionCost, CostFn, as_cost_fn
from poise.balance.packing import Pieces, cut_pieces, packed_steps, packed_terms, split_naive, split_packed
from poise.balance.sampler import DEFAULT_ALPHA, BalancedBatchSampler
from poise.balance.sharding import EpochPlan, plan_fixed_steps, take_step


class PackedBatchSampler(BalancedBatchSampler):
    """This rank's pieces of packed rows, step by step (see module doc).

    Args:
        doc_lengths: tokens per document (metadata; documents are never loaded to be planned).
        rank, world_size: this rank and the number of ranks.
        row_tokens: tokens in one packed row; longer documents are cut into pieces of it.
        rows_per_rank: rows per rank per step of the naive packer (a step: ``world_size``
            times as many rows; poise's packer may give ranks different numbers of them).
        cost_fn: length -> cost units of one document (default ``L + DEFAULT_ALPHA·L²``).
        speeds: relative speed per rank (default all equal).
        seed: shuffling seed, shared by all ranks.
        naive: split steps as the naive packer does (equal runs of rows per rank), whatever
            the speeds.

    Attributes:
        pieces: every document's pieces (:class:`~poise.balance.packing.Pieces`).
        plan_s: seconds spent splitting steps so far (the planner's cost).
        planned_steps: steps split so far.
    """

    max_shift = 0  # the steps are the naive packer's: no piece moves between them

    def __init__(
        self,
        doc_lengths: Sequence[int] | np.ndarray,
        *,
        rank: int,
        world_size: int,
        row_tokens: int,
        rows_per_rank: int,
        cost_fn: CostFn | None = None,
        speeds: Sequence[float] | None = None,
        seed: int = 0,
        naive: bool = False,
    ) -> None:
        if rows_per_rank < 1:
            raise ValueError(f"rows per rank={rows_per_rank} must be >= 1 (packed rows per rank per step)")
        self.doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        self.pieces: Pieces = cut_pieces(self.doc_lengths, row_tokens)
        self.row_tokens, self.rows_per_rank, self.naive = int(row_tokens), int(rows_per_rank), naive
        self.plan_s, self.planned_steps = 0.0, 0
        splitter = split_naive if naive else split_packed
        self._splitter = functools.partial(splitter, row_tokens=self.row_tokens)
        super().__init__(self.pieces.lengths, rank=rank, world_size=world_size,
                         batch_cost=float(world_size * rows_per_rank * row_tokens), cost_fn=cost_fn, speeds=speeds,
                         seed=seed, bucket_steps=1)

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        """The naive packer's steps of ``epoch`` (of ``remaining`` only, when resumed on another
        number of ranks), each its own window: no boundary moves."""
        return plan_fixed_steps(packed_steps(
            self.pieces, row_tokens=self.row_tokens, rows_per_step=self.world_size * self.rows_per_rank,
            seed=self.seed, epoch=epoch, num_ranks=self.world_size, subset=self.remaining))

    def _like(self, world_size: int) -> BalancedBatchSampler:
        return PackedBatchSampler(self.doc_lengths, rank=0, world_size=world_size, row_tokens=self.row_tokens,
                                  rows_per_rank=self.rows_per_rank, cost_fn=self.cost_fn, seed=self.seed,
                                  naive=self.naive)

    def global_batches(self, step: int) -> list[np.ndarray]:
        """Every rank's piece indices for ``step``, row by row (see module doc); a step is
        split once, with the speeds current when it is first asked for."""
        if step not in self._splits:
            if step != self._plan.taken:
                raise ValueError(f"step {step} asked before step {self._plan.taken}: steps are taken in order")
            cost = self.rank_cost_fns if self.rank_cost_fns is not None else self.cost_fn
            started = time.perf_counter()
            self._splits[step] = take_step(self._plan, self.lengths, cost, self.speeds, max_shift=0,
                                           split=self._splitter).batches
            self.plan_s += time.perf_counter() - started
            self.planned_steps += 1
        return self._splits[step]

    def cost_terms(self, batch_lengths: np.ndarray) -> tuple[float, float]:
        """A rank's measured step's cost terms: its rows' tokens and ``Σ L²`` plus padding
        (:func:`~poise.balance.packing.packed_terms`); its cost is ``terms[0] + α·terms[1]``."""
        return packed_terms(batch_lengths, self.row_tokens)

    def piece_terms(self) -> np.ndarray:
        """Loss terms of every piece: its tokens but the first (a causal LM predicts each token
        from those before it in its document, and positions restart at each piece)."""
        return (self.lengths - 1).astype(np.float64)


def make_packed_sampler(strategy: str, doc_lengths: Sequence[int] | np.ndarray, *, rank: int, world_size: int,
                        row_tokens: int, batch_size: int | None = None, batch_tokens: int | None = None,
                        cost_fn: CostFn | None = None, seed: int = 0) -> PackedBatchSampler:
    """The packed sampler of a balance ``strategy``: ``static`` splits as the naive packer does;
    ``auto``, ``cost`` and ``dynamic`` by cost and speed (re-planned from measured speeds under
    ``auto`` and ``dynamic``). The budget: ``batch_size`` rows per rank per step, or
    ``batch_tokens`` tokens per rank (a whole number of rows).

    Raises:
        ValueError: for an unknown strategy, or a budget that is not one whole number of rows.
    """
    if strategy not in ("auto", "static", "cost", "dynamic"):
        raise ValueError(f"balance strategy {strategy!r} is unknown: allowed are auto, static, cost, dynamic")
    if (batch_size is None) == (batch_tokens is None):
        raise ValueError("packed rows (row_tokens=...): give batch_size (rows per rank per step) or batch_tokens")
    if batch_tokens is not None:
        if batch_tokens % row_tokens:
            raise ValueError(f"batch_tokens={batch_tokens} is not a whole number of rows of row_tokens={row_tokens}")
        batch_size = batch_tokens // row_tokens
    assert batch_size is not None
    cost = as_cost_fn(cost_fn) if cost_fn is not None else AttentionCost(DEFAULT_ALPHA)
    return PackedBatchSampler(doc_lengths, rank=rank, world_size=world_size, row_tokens=row_tokens,
                              rows_per_rank=batch_size, cost_fn=cost, seed=seed, naive=strategy == "static")


__all__ = ["PackedBatchSampler", "make_packed_sampler"]
