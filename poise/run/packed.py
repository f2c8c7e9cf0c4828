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
        sliced = {k: v[start:stop] if hasattr(v, "__len__") and not isinstance(v, str) and len(v) == length else v
                  for k, v in item.items()}
        if all(sliced[k] is item[k] for k in item):
            raise ValueError(f"a document of {length} tokens: none of its fields {sorted(item)} has {length} entries "
                             "to cut into pieces (give lengths= as the documents' token counts)")
        return sliced
    raise ValueError(f"a document of type {type(item).__name__} cannot be cut into pieces: give tensors, arrays, "
                     "lists or dicts of them, or documents no longer than row_tokens")


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
        if p.first[doc + 1] - p.first[doc] == 1:
            return item  # a whole document: as the dataset gives it
        start = int(p.start[index])
        whole = int(p.start[p.first[doc + 1] - 1] + p.lengths[p.first[doc + 1] - 1])
        return cut(item, start, start + int(p.lengths[index]), whole)


__all__ = ["PieceView", "cut"]
