"""The data a session plans over: :class:`Data`, one description of samples, budget and run length.

A session needs to know, before the first step, what each sample costs (to split steps
across ranks), what the loss averages over (to weight unequal batches exactly), how big a
step is, and how long the run is (lossy codecs start after a share of it). :class:`Data`
holds all of it in one value, checked once; :func:`plan_sampler` turns it into this rank's
batch sampler for a balance strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from poise.balance import BalancedBatchSampler, StaticSchedule, make_sampler
from poise.balance.packed_sampler import PackedBatchSampler, make_packed_sampler
from poise.balance.sampler import sampler_inputs
from poise.config import BalanceConfig
from poise.run.packed import PieceView

Sampler = StaticSchedule | BalancedBatchSampler


@dataclasses.dataclass(frozen=True, kw_only=True)
class Data:
    """What is trained on, per rank and step: what each sample costs (to split a step across
    the ranks), what the loss averages over (to weight unequal batches exactly), the budget of
    a step and the run's length. Give ``lengths`` or ``costs`` (or neither, with ``dataset``:
    every sample then costs the same) and one budget, or ``sampler``.

    Args:
        lengths: per-sample size in tokens (metadata, one per dataset sample): what a sample
            costs to train on is ``cost_fn(length)``.
        costs: instead of ``lengths``, per-sample cost in any unit, used as it is.
        cost_fn: length -> cost units (a function of one number or of an array); default
            ``L + α·L²`` with the balance config's ``cost_alpha`` (attention) or α = 0 (linear).
        loss_terms: per-sample count of what your loss averages over (tokens predicted, or 1
            per sample, the default). The loss weight of a step needs it to be exact.
        dataset: your dataset, only to check that ``lengths`` has one entry per sample.
        sampler: instead of ``lengths``/``costs`` and a budget, a sampler of your own making
            (``poise.balance.make_sampler``, ``BalancedBatchSampler``, ``StaticSchedule``).
        batch_size: samples per rank per step (static), or the step's budget as that many
            samples of average cost per rank (cost, dynamic).
        batch_tokens: instead, padded tokens per rank per step.
        batch_cost: instead, cost units per step over all ranks together (cost, dynamic).
        row_tokens: pack documents into rows of this many tokens (LLM pre-training's packed
            sequences, attention per document): ``lengths`` are then the documents' token
            counts, documents longer than a row are cut into pieces of it, ``batch_size``
            counts rows per rank per step (``batch_tokens``: tokens, whole rows), and poise
            decides which pieces go in which row on which rank so that every rank's ``Σ
            cost(L)`` over its pieces, divided by its speed, is equal
            (:mod:`poise.balance.packing`; ``static``: rows filled in order, equal rows per
            rank). Each piece's loss terms are its tokens but the first. None: padded batches.
        seed: seed of the data order, the same on every rank.
        accum_steps: micro-batches per optimizer step (gradient accumulation): the steps of a
            window but the last run without reducing; :attr:`Step.sync` says which.
        total_steps: optimizer steps the run will take, if known: lossy codecs start after a
            twentieth of it, and no re-plan runs after the last.
        lr_warmup_steps: your learning-rate warm-up, in optimizer steps (lossy codecs start
            after twice it).

    Raises:
        ValueError: one line, for values that disagree with each other.
    """

    lengths: Sequence[int] | np.ndarray | None = None
    costs: Sequence[float] | np.ndarray | None = None
    cost_fn: Callable[..., Any] | None = None
    loss_terms: Sequence[float] | np.ndarray | None = None
    dataset: Any = None
    sampler: Sampler | None = None
    batch_size: int | None = None
    batch_tokens: int | None = None
    batch_cost: float | None = None
    row_tokens: int | None = None
    seed: int = 0
    accum_steps: int = 1
    total_steps: int | None = None
    lr_warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.accum_steps < 1:
            raise ValueError(f"accum_steps={self.accum_steps} must be >= 1")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"total_steps={self.total_steps} must be >= 1 (or None: unknown)")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if self.sampler is not None and (
                self.lengths is not None or self.costs is not None or self.cost_fn is not None
                or (self.batch_size, self.batch_tokens, self.batch_cost) != (None,) * 3):
            raise ValueError("sampler= comes with its own lengths, costs and budget: give none of lengths, "
                             "costs, cost_fn, batch_size, batch_tokens, batch_cost")
        if self.row_tokens is not None:
            self._check_packed()

    def _check_packed(self) -> None:
        """One line for what packed rows cannot take."""
        if isinstance(self.row_tokens, bool) or not isinstance(self.row_tokens, int) or self.row_tokens < 2:
            raise ValueError(f"row_tokens={self.row_tokens!r} must be an integer >= 2 (tokens in one packed row)")
        given = [name for name in ("sampler", "costs", "loss_terms", "batch_cost") if getattr(self, name) is not None]
        if given:
            raise ValueError(f"row_tokens={self.row_tokens} packs documents by their lengths=: {given[0]}= does not "
                             "apply (each piece's loss terms are its tokens but the first; count others with "
                             "step.backward(loss, num_items=...)); give lengths= and batch_size= (rows per rank)")
        if self.lengths is None:
            raise ValueError(f"row_tokens={self.row_tokens}: give lengths=, the documents' token counts")

    def terms(self) -> np.ndarray | None:
        """``loss_terms`` as an array (None: one term per sample)."""
        return None if self.loss_terms is None else np.asarray(self.loss_terms, dtype=np.float64)


def plan_sampler(data: Data, balance: BalanceConfig, rank: int, world_size: int) -> Sampler:
    """This rank's batch sampler for ``balance``'s strategy, checked against ``data``.

    Raises:
        ValueError: one line, when the sampler, the loss terms or the dataset disagree with
            the samples or the process group.
    """
    terms = data.terms()
    if data.sampler is not None:
        sampler = data.sampler
        if (sampler.rank, sampler.world_size) != (rank, world_size):
            raise ValueError(f"the sampler was made for rank {sampler.rank} of {sampler.world_size}, but this "
                             f"process is rank {rank} of {world_size}")
        if isinstance(sampler, PackedBatchSampler) and terms is not None:
            # the session weighs a packed step by its pieces' own terms (tokens - 1 each): given terms would be dropped
            raise ValueError("loss_terms= comes with a packed sampler, which counts each piece's own terms "
                             "(tokens - 1): give no loss_terms")
        if balance.strategy == "dynamic" and not isinstance(sampler, BalancedBatchSampler):
            raise ValueError(f"balance 'dynamic' re-plans a BalancedBatchSampler, not a {type(sampler).__name__}")
    elif data.row_tokens is not None:
        values, cost = sampler_inputs(data.lengths, None, data.cost_fn, balance.cost_model, balance.cost_alpha, None)
        sampler = make_packed_sampler(balance.strategy, values, rank=rank, world_size=world_size,
                                      row_tokens=data.row_tokens, batch_size=data.batch_size,
                                      batch_tokens=data.batch_tokens, cost_fn=cost, seed=data.seed)
    else:
        count = len(data.dataset) if data.dataset is not None else None if terms is None else len(terms)
        values, cost = sampler_inputs(data.lengths, data.costs, data.cost_fn, balance.cost_model,
                                      balance.cost_alpha, count)
        sampler = make_sampler(balance.strategy, values, rank=rank, world_size=world_size, cost_fn=cost,
                               seed=data.seed, batch_size=data.batch_size, batch_tokens=data.batch_tokens,
                               batch_cost=data.batch_cost, bucket_steps=balance.bucket_steps)
    if terms is not None and len(terms) != len(sampler.lengths):
        raise ValueError(f"loss_terms has {len(terms)} entries but there are {len(sampler.lengths)} samples")
    if data.dataset is not None:
        check_dataset(data.dataset, documents(sampler))
    return sampler


def documents(sampler: Sampler) -> np.ndarray:
    """The lengths of the samples of the user's dataset: the documents' of a packed sampler
    (whose ``lengths`` are its pieces'), else the sampler's ``lengths``."""
    return sampler.doc_lengths if isinstance(sampler, PackedBatchSampler) else sampler.lengths


def loader_dataset(dataset: Any, sampler: Sampler) -> Any:
    """What a DataLoader over ``sampler``'s batches loads from: ``dataset`` itself, or for a
    packed sampler its pieces (:class:`~poise.run.packed.PieceView`), after checking that it
    has one sample per entry of :func:`documents`."""
    check_dataset(dataset, documents(sampler))
    return PieceView(dataset, sampler.pieces) if isinstance(sampler, PackedBatchSampler) else dataset


def check_dataset(dataset: Any, lengths: np.ndarray) -> None:
    """Raise a one-line ValueError unless ``dataset`` has one sample per entry of ``lengths``."""
    if len(dataset) != len(lengths):
        raise ValueError(f"the dataset has {len(dataset)} samples but lengths has {len(lengths)}")


def check_loader(loader: Any, sampler: Sampler, lengths: np.ndarray) -> None:
    """One line, before any step, for a loader whose batches are not the ones the session
    weights: another batch sampler (``accelerator.prepare`` wraps it and takes every other
    batch), or a dataset whose length is not the number of samples the plan covers."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not sampler:
        wrapped = getattr(batch_sampler, "batch_sampler", None) is sampler
        raise ValueError("session.steps(loader): the loader must batch with session.sampler itself (use "
                         "session.dataloader(dataset)); " + (
                             f"it batches with a {type(batch_sampler).__name__} around it (accelerator.prepare"
                             "(loader)?), which takes only some of the session's batches, so the batch in hand "
                             "would not be the one weighted: do not prepare the session's loader"
                             if wrapped else f"it batches with {type(batch_sampler).__name__}"))
    dataset = getattr(loader, "dataset", None)
    if isinstance(sampler, PackedBatchSampler) and not isinstance(dataset, PieceView):
        raise ValueError("session.steps(loader): a packed session's batches are pieces of documents: make the "
                         "loader with session.dataloader(dataset) (or over poise.run.packed.PieceView(dataset, "
                         "session.sampler.pieces))")
    if dataset is not None and hasattr(dataset, "__len__"):
        check_dataset(dataset, lengths)


# Data's fields, by name (Session.from_kwargs tells them from the session's own keywords).
DATA_FIELDS = tuple(f.name for f in dataclasses.fields(Data))

__all__ = ["DATA_FIELDS", "Data", "Sampler", "check_dataset", "check_loader", "documents", "loader_dataset",
           "plan_sampler"]
