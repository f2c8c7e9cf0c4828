"""The packing planner: documents packed into rows of a fixed length, rows split among ranks.

LLM pre-training does not pad a batch to its longest sample: it packs documents one after the
other into rows of a fixed length (``row_tokens``), each document attending only to itself
(a document mask), with positions restarting at each document. Every row then holds the
same number of tokens, yet a rank's time is not its tokens': attention costs ``L²`` per
document of ``L`` tokens, so the rank whose rows hold the long documents is the slow one.
Pure functions of (documents' lengths, row length, cost function, ranks' speeds): every rank
computes the same plan with no communication, as :mod:`poise.balance.sharding`'s.

**Pieces.** A document longer than a row is cut at the row length, as packing collators do
(:func:`cut_pieces`): pieces of ``row_tokens`` and a last, shorter one, each its own document
for attention. The samplers plan pieces; a piece view of the dataset slices documents.

**Steps** (:func:`packed_steps`). An epoch visits documents in a seeded random order, their
pieces in order, filled into rows in that order (next fit: a row is closed when the next
piece does not fit), ``rows_per_step`` rows to a step. The naive packer stops there
(:func:`split_naive`): each rank takes an equal run of the step's rows, as a packing data
loader under ``DistributedSampler`` does. Both packers train the same pieces in each step,
so they are compared on the same data.

**Split** (:func:`split_packed`). The step's pieces are divided among ranks so that every
rank's *predicted time*, its cost divided by its speed, is as equal as possible, and packed
into that rank's rows. A rank's cost is ``Σ cost(L)`` over its pieces plus its rows' padding
at ``cost(1)`` a token (a padding token goes through the linear layers and attends nothing):
for ``cost(L) = L + α·L²``, ``rows·row_tokens + α·(Σ L² + padding)``. Algorithm: pieces in
decreasing length (LPT for uniform machines, as :func:`~poise.balance.sharding.split_step`),
each to the rank where it would finish earliest, into that rank's fullest row it fits (best
fit decreasing: a row is opened only when no row of the rank has room, which keeps a rank's
rows few and full). Ranks may get different numbers of rows; the session's loss weight (each
rank's share of the step's loss terms, :mod:`poise.balance.weights`) keeps the step's
gradient the mean over all its tokens. O(n log n + n·R·log rows) for n pieces over R ranks.

**Rows in order.** A rank's pieces are handed out row by row, each row's pieces in the order
they were placed, so a collate that fills rows in order (:func:`rows_in_order`, next fit)
rebuilds exactly the planned rows: a row was opened for a piece that fitted no earlier row,
and an earlier row only fills up afterwards.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from poise.balance.costs import CostFn
from poise.balance.sharding import StepSplit, checked_speeds, epoch_order


@dataclass(frozen=True)
class Pieces:
    """Every document cut at the row length (see module doc).

    Attributes:
        doc: the document of each piece.
        start: the piece's first token in its document.
        lengths: the piece's tokens (1..row_tokens).
        first: index of each document's first piece (``num_docs + 1`` offsets: document ``d``
            is pieces ``first[d]:first[d + 1]``).
    """

    doc: np.ndarray
    start: np.ndarray
    lengths: np.ndarray
    first: np.ndarray


def cut_pieces(doc_lengths: Sequence[int] | np.ndarray, row_tokens: int) -> Pieces:
    """Cut every document longer than ``row_tokens`` into pieces of ``row_tokens`` tokens and
    a shorter last one (documents in order, each one's pieces in order).

    Raises:
        ValueError: for a row length below 1 or a document without tokens.
    """
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if row_tokens < 1:
        raise ValueError(f"row_tokens={row_tokens} must be >= 1 (tokens in one packed row)")
    if lengths.ndim != 1 or len(lengths) == 0 or np.any(lengths < 1):
        raise ValueError("documents' lengths must be one positive token count per document")
    counts = -(-lengths // row_tokens)  # pieces per document
    first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    within = np.arange(int(first[-1]), dtype=np.int64) - first[doc]  # the piece's place in its document
    start = within * row_tokens
    return Pieces(doc=doc, start=start, lengths=np.minimum(lengths[doc] - start, row_tokens), first=first)


def rows_in_order(lengths: Sequence[int] | np.ndarray, row_tokens: int) -> list[tuple[int, int]]:
    """Rows of ``lengths`` filled in order (next fit): ``(first, end)`` positions of each row;
    a row closes when the next piece does not fit. What a packing collate does, and how a
    planned rank's pieces become its rows again (see module doc)."""
    rows: list[tuple[int, int]] = []
    start, used = 0, 0
    for k, length in enumerate(np.asarray(lengths).tolist()):
        if k > start and used + length > row_tokens:
            rows.append((start, k))
            start, used = k, 0
        used += length
    if len(lengths):
        rows.append((start, len(lengths)))
    return rows


def row_count(lengths: Sequence[int] | np.ndarray, row_tokens: int) -> int:
    """Rows that ``lengths``, filled in order, take."""
    return len(rows_in_order(lengths, row_tokens))


def packed_terms(lengths: np.ndarray, row_tokens: int) -> tuple[float, float]:
    """The cost terms of one rank's pieces in row order, for ``cost(L) = L + α·L²``: the
    tokens its rows hold (``rows·row_tokens``, padding included) and ``Σ L²`` plus the padding
    tokens, so that the rank's cost (module doc) is ``terms[0] + α·terms[1]``."""
    lengths = np.asarray(lengths, dtype=np.float64)
    held = row_count(lengths, row_tokens) * row_tokens
    return float(held), float(np.sum(lengths * lengths) + held - lengths.sum())


def packed_steps(pieces: Pieces, *, row_tokens: int, rows_per_step: int, seed: int, epoch: int,
                 num_ranks: int, subset: np.ndarray | None = None) -> list[np.ndarray]:
    """One epoch's steps, each the piece indices of ``rows_per_step`` rows filled in order
    (see module doc); the epoch's last rows form a smaller step, or join the step before
    when they are fewer than ranks. Every piece (of ``subset``, when given) lands in one step.

    Raises:
        ValueError: when the pieces fill fewer rows than ranks.
    """
    order = epoch_order(len(pieces.first) - 1, seed, epoch)
    runs = [np.arange(pieces.first[d], pieces.first[d + 1]) for d in order.tolist()]
    stream = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
    if subset is not None:
        stream = stream[np.isin(stream, subset)]
    rows = rows_in_order(pieces.lengths[stream], row_tokens)
    if len(rows) < num_ranks:
        raise ValueError(f"the documents fill {len(rows)} rows of {row_tokens} tokens: too few for {num_ranks} ranks")
    cuts = list(range(0, len(rows), rows_per_step))
    if len(rows) - cuts[-1] < num_ranks and len(cuts) > 1:
        cuts.pop()  # a tail of fewer rows than ranks joins the step before
    bounds = [rows[c][0] for c in cuts] + [len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class PackedSplit(StepSplit):
    """One packed step divided among ranks: ``batches`` (each rank's pieces, row by row) and
    ``predicted_s`` as :class:`~poise.balance.sharding.StepSplit`'s, and the rows themselves.

    Attributes:
        rows: per rank, its rows, each an array of piece indices in order.
    """

    rows: list[list[np.ndarray]] = field(default_factory=list)


def rank_cost(fn: CostFn, lengths: np.ndarray, row_tokens: int) -> float:
    """One rank's cost of its pieces in row order (cost units; see module doc)."""
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return 0.0
    padding = row_count(lengths, row_tokens) * row_tokens - int(lengths.sum())
    return float(np.sum(fn(lengths))) + padding * float(fn(np.array([1.0]))[0])


def _split(rows: list[list[np.ndarray]], lengths: np.ndarray, fns: list[CostFn], speeds: np.ndarray,
           row_tokens: int) -> PackedSplit:
    batches = [np.concatenate(r) if r else np.zeros(0, dtype=np.int64) for r in rows]
    predicted = np.array([rank_cost(fns[r], lengths[b], row_tokens) / speeds[r] for r, b in enumerate(batches)])
    return PackedSplit(batches=batches, predicted_s=predicted, rows=rows)


def split_naive(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn | Sequence[CostFn], speeds: np.ndarray,
                *, row_tokens: int) -> PackedSplit:
    """The naive packer's split: the step's rows filled in order, an equal run of them to each
    rank in turn (one more to the first ranks when they do not divide); speeds only predict."""
    speeds, fns = checked_speeds(speeds, cost_fn)
    step = np.asarray(step, dtype=np.int64)
    lengths = np.asarray(lengths)
    rows = [step[a:b] for a, b in rows_in_order(lengths[step], row_tokens)]
    runs = np.array_split(np.arange(len(rows)), len(speeds))
    return _split([[rows[k] for k in run.tolist()] for run in runs], lengths, fns, speeds, row_tokens)


class _Rows:
    """One rank's rows while a step is planned: free tokens of each row kept sorted, for best fit."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (free tokens, row), sorted
        self.rows: list[list[int]] = []

    def fitting(self, length: int) -> int:
        """Position in ``free`` of the fullest row with room for ``length`` (len(free): none)."""
        return bisect.bisect_left(self.free, (length, -1))

    def place(self, piece: int, length: int, row_tokens: int) -> None:
        at = self.fitting(length)
        if at < len(self.free):
            free, row = self.free.pop(at)
        else:
            free, row = row_tokens, len(self.rows)
            self.rows.append([])
        self.rows[row].append(piece)
        bisect.insort(self.free, (free - length, row))


def _pack(pieces: list[int], lengths: np.ndarray, row_tokens: int) -> list[list[int]]:
    """Best fit decreasing of ``pieces`` into rows (each row's pieces in placement order)."""
    rows = _Rows()
    for p in sorted(pieces, key=lambda p: (-int(lengths[p]), p)):
        rows.place(p, int(lengths[p]), row_tokens)
    return rows.rows


def split_packed(step: np.ndarray, lengths: np.ndarray, cost_fn: CostFn | Sequence[CostFn], speeds: np.ndarray,
                 *, row_tokens: int) -> PackedSplit:
    """Divide one packed step's pieces among ranks by predicted time and pack each rank's rows
    (see module doc). Every rank gets at least one piece when the step has as many as ranks.

    ``cost_fn`` may be one per rank (each rank's ``speeds`` entry then in its own cost units),
    as :func:`~poise.balance.sharding.split_step`'s.

    Raises:
        ValueError: if a speed is not positive and finite.
    """
    speeds, fns = checked_speeds(speeds, cost_fn)
    step = np.asarray(step, dtype=np.int64)
    lengths = np.asarray(lengths)
    num_ranks = len(speeds)
    order = step[np.lexsort((step, -lengths[step]))]  # longest first; ties by index
    sizes = lengths[order]
    # every piece's cost and one padding token's cost, in every rank's units
    item = np.stack([np.asarray(f(sizes), dtype=np.float64) for f in fns]).T.tolist()  # [pieces][ranks]
    pad = [float(f(np.array([1.0]))[0]) for f in fns]
    rate = [1.0 / float(v) for v in speeds]
    load = [0.0] * num_ranks  # cost units so far, padding of open rows included
    ranks = [_Rows() for _ in range(num_ranks)]
    for piece, length, costs in zip(order.tolist(), sizes.tolist(), item, strict=True):
        best, best_finish = 0, float("inf")
        for r in range(num_ranks):
            if ranks[r].fitting(length) < len(ranks[r].free):
                added = costs[r] - length * pad[r]  # fills padding already paid for
            else:
                added = costs[r] + (row_tokens - length) * pad[r]  # a new row, and its padding
            finish = (load[r] + added) * rate[r]
            if finish < best_finish:
                best, best_finish = r, finish
        load[best] = best_finish / rate[best]
        ranks[best].place(piece, length, row_tokens)
    rows = [[list(row) for row in rk.rows] for rk in ranks]
    # A very slow rank may have been given nothing: hand it the shortest piece of the rank
    # with most pieces, and repack that rank's rows, so every rank takes part in every step.
    counts = [sum(len(row) for row in rk) for rk in rows]
    for r in [r for r in range(num_ranks) if counts[r] == 0]:
        donor = int(np.argmax(counts))
        if counts[donor] <= 1:
            break
        held = [p for row in rows[donor] for p in row]
        shortest = min(held, key=lambda p: (int(lengths[p]), -p))
        rows[r] = [[shortest]]
        rows[donor] = _pack([p for p in held if p != shortest], lengths, row_tokens)
        counts[r], counts[donor] = 1, counts[donor] - 1
    as_arrays = [[np.asarray(row, dtype=np.int64) for row in rk] for rk in rows]
    return _split(as_arrays, lengths, fns, speeds, row_tokens)


__all__ = ["PackedSplit", "Pieces", "cut_pieces", "packed_steps", "packed_terms", "rank_cost", "row_count",
           "rows_in_order", "split_naive", "split_packed"]
