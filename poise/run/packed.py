"""Packed rows in a user's loop: the dataset seen as pieces of documents, :class:`PieceView`.

With ``poise.Data(lengths=..., row_tokens=...)`` the session plans *pieces*: every document,
cut at the row length when it is longer (:func:`poise.balance.packing.cut_pieces`). A batch
of the session's sampler is a list of piece indices, row by row; :class:`PieceView` turns
your dataset of documents into one of pieces, so a DataLoader loads exactly those
(``session.dataloader(dataset)`` puts it in for you). Your collate then fills rows in order
(a row closes when the next piece does not fit: :func:`poise.balance.packing.rows_in_order`)
and restarts positions at each piece, or flattens the batch (Hugging Face's
``DataCollatorWithFlattening``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from poise.balance.packing import Pieces


def cut(item: Any, start: int, stop: int, length: int) -> Any:
    """Tokens ``start:stop`` of one document ``item`` (``length`` tokens): a tensor, array or
    list is sliced on its first dimension; a dict (a Hugging Face example) has every value of
    ``length`` entries sliced and the others kept.

    Raises:
        ValueError: for an item that is none of these, or a dict with no value of the document's length.
    """
    if isinstance(item, (torch.Tensor, np.ndarray, list, tuple)):
        return item[start:stop]
    if isinstance(item, dict):
        return {k: v[start:stop] if _sized(v) and len(v) == length else v for k, v in item.items()}
    raise ValueError(f"a document of type {type(item).__name__} cannot be cut into pieces: give tensors, arrays, "
                     "lists or dicts of them, or documents no longer than row_tokens")


def _sized(value: Any) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, str)


def check_length(item: Any, length: int, doc: int) -> None:
    """Refuse document ``doc`` when it does not hold the ``length`` tokens ``lengths=`` gave for
    it: the plan's rows, pieces and loss weights all assume that count, and a piece cut from a
    shorter or longer document would train empty, cut-off or extra tokens.

    Raises:
        ValueError: a sequence of another length, or a dict with no field of ``length`` entries.
    """
    if isinstance(item, (torch.Tensor, np.ndarray, list, tuple)):
        if len(item) != length:
            raise ValueError(f"document {doc} has {len(item)} tokens but lengths= gives {length}: give every "
                             "document's own token count")
    elif isinstance(item, dict):
        if not any(_sized(v) and len(v) == length for v in item.values()):
            raise ValueError(f"document {doc}: none of its fields {sorted(item)} has the {length} entries lengths= "
                             "gives for it: give every document's own token count")


class PieceView(Dataset[Any]):
    """Your dataset of documents as a dataset of pieces (see module doc): item ``i`` is piece
    ``i``, its document's tokens from the piece's start, cut to the piece's length."""

    def __init__(self, dataset: Any, pieces: Pieces) -> None:
        self.dataset, self.pieces = dataset, pieces

    def __len__(self) -> int:
        return len(self.pieces.lengths)

    def __getitem__(self, index: int) -> Any:
        p = self.pieces
        doc = int(p.doc[index])
        item = self.dataset[doc]
        last = p.first[doc + 1] - 1
        whole = int(p.start[last] + p.lengths[last])
        check_length(item, whole, doc)
        if last == p.first[doc]:
            return item  # a whole document: as the dataset gives it
        start = int(p.start[index])
        return cut(item, start, start + int(p.lengths[index]), whole)


__all__ = ["PieceView", "check_length", "cut"]
