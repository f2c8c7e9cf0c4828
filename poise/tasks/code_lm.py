"""The ``code-lm`` task: a byte-level transformer language model on real Python source.

The data is the stdlib definition corpus of :mod:`poise.tasks.stdlib_corpus` (indexing,
caching and the train/validation split live there), truncated here to ``max_seq_len``
bytes per sample at load time. The model is a small pre-LN decoder-only transformer over
the 256 byte values whose blocks live in ``model.blocks`` so that a pipeline can cut
between them.

Packed (``packed=True``): training documents are whole definitions, cut into pieces of
``max_seq_len`` bytes by the sampler when longer, and :func:`collate_packed` fills rows of
``max_seq_len`` bytes with them in order. The model then attends within each document only
(:func:`document_attention`: one causal attention per document, so its cost follows Σ L²
over the documents rather than the row's length squared) and positions restart at each
document: a packed row computes what each of its documents alone would.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from poise.tasks.base import IGNORE_INDEX, Batch, EvalSums, Task
from poise.tasks.stdlib_corpus import MIN_SAMPLE_BYTES, Corpus, load_corpus, split_indices

VOCAB_SIZE = 256
"""Byte values; every token id is one byte."""


# --------------------------------------------------------------------------- data


class ByteSampleDataset(Dataset[torch.Tensor]):
    """Map-style dataset of byte samples; item ``i`` is a uint8 tensor of its (truncated) bytes.

    Args:
        blob: uint8 array holding all samples.
        offsets: int64 byte offset of each sample in ``blob``.
        lengths: int64 length of each sample in bytes, already truncated.
    """

    def __init__(self, blob: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        if offsets.shape != lengths.shape:
            raise ValueError(f"offsets {offsets.shape} and lengths {lengths.shape} differ")
        self.blob = blob
        self.offsets = offsets
        self.lengths = lengths

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        start = int(self.offsets[index])
        # Copy so the tensor never aliases (and pins) the shared blob.
        return torch.from_numpy(self.blob[start : start + int(self.lengths[index])].copy())


def make_datasets(corpus: Corpus, max_seq_len: int) -> tuple[ByteSampleDataset, ByteSampleDataset]:
    """Split the corpus by file and truncate every sample to ``max_seq_len`` bytes."""
    train, validation = split_indices(corpus)
    truncated = np.minimum(corpus.lengths, max_seq_len)
    return (
        ByteSampleDataset(corpus.blob, corpus.offsets[train], truncated[train]),
        ByteSampleDataset(corpus.blob, corpus.offsets[validation], truncated[validation]),
    )


def collate_bytes(samples: Sequence[torch.Tensor]) -> Batch:
    """Right-pad byte samples to the longest and shift them into (inputs, targets).

    ``inputs`` is ``[B, L-1]`` int64 (padding holds byte 0, which the causal mask keeps
    away from real positions); ``targets`` is ``[B, L-1]`` int64 with ``IGNORE_INDEX`` where
    the next byte is padding. ``num_tokens`` is the real bytes in the batch.

    Raises:
        ValueError: the batch is empty or a sample has fewer than 2 bytes.
    """
    if not samples:
        raise ValueError("collate_bytes got an empty batch; need at least one sample")
    lengths = torch.tensor([len(s) for s in samples], dtype=torch.int64)
    if int(lengths.min()) < MIN_SAMPLE_BYTES:
        raise ValueError(f"sample of {int(lengths.min())} bytes; need at least 2 bytes")
    tokens = torch.zeros(len(samples), int(lengths.max()), dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample)] = sample.to(torch.int64)
    targets = tokens[:, 1:].clone()
    positions = torch.arange(targets.shape[1])
    targets[positions[None, :] >= (lengths - 1)[:, None]] = IGNORE_INDEX
    return Batch(
        inputs=tokens[:, :-1].contiguous(),
        targets=targets,
        num_samples=len(samples),
        num_tokens=int(lengths.sum()),
        num_padded_tokens=int(tokens.numel()),
    )


def collate_packed(samples: Sequence[torch.Tensor], *, row_tokens: int) -> Batch:
    """Fill rows of ``row_tokens`` bytes with ``samples`` (documents, or pieces of them) in
    order: a row closes when the next one does not fit (next fit, as the packed sampler plans
    them: its rows come back exactly); a sample longer than a row is cut at the row length.

    ``inputs`` is ``[rows, row_tokens]`` int64 (padding holds byte 0 after a row's last
    document, which attends nothing); ``targets`` holds each document's next byte and
    ``IGNORE_INDEX`` at its last byte and on padding, so a document of L bytes has L - 1 loss
    terms; ``rows`` gives each row's documents' lengths. A piece of one byte (the last of a
    document one byte longer than rows) has no loss term.

    Raises:
        ValueError: the batch is empty or a sample has no bytes.
    """
    if not samples:
        raise ValueError("collate_packed got an empty batch; need at least one sample")
    pieces = [s[start:start + row_tokens] for s in samples for start in range(0, len(s), row_tokens)]
    if len(pieces) < len(samples):
        raise ValueError("collate_packed got a sample of 0 bytes; need at least 1")
    rows: list[list[torch.Tensor]] = []
    used = row_tokens
    for piece in pieces:
        if used + len(piece) > row_tokens:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += len(piece)
    tokens = torch.zeros(len(rows), row_tokens, dtype=torch.int64)
    targets = torch.full((len(rows), row_tokens), IGNORE_INDEX, dtype=torch.int64)
    for r, row in enumerate(rows):
        offset = 0
        for piece in row:
            values = piece.to(torch.int64)
            tokens[r, offset:offset + len(piece)] = values
            targets[r, offset:offset + len(piece) - 1] = values[1:]
            offset += len(piece)
    real = sum(len(p) for p in pieces)
    return Batch(inputs=tokens, targets=targets, num_samples=len(pieces), num_tokens=real,
                 num_padded_tokens=int(tokens.numel()), rows=tuple(tuple(len(p) for p in row) for row in rows))


# --------------------------------------------------------------------------- model


Rows = tuple[tuple[int, ...], ...]
"""Packed rows: each row's documents' lengths in tokens, in order (:attr:`Batch.rows`)."""


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Causal attention of each document with itself only (a block-diagonal document mask):
    ``q, k, v`` are ``[rows, heads, row_tokens, head_dim]``; one
    ``scaled_dot_product_attention`` per document, so the cost is Σ L² over the documents,
    not the row's length squared. Positions after a row's last document (padding) attend
    nothing and get zeros."""
    length = q.shape[2]
    out = []
    for r, lengths in enumerate(rows):
        parts, start = [], 0
        for doc in lengths:
            span = slice(start, start + doc)
            parts.append(F.scaled_dot_product_attention(q[r:r + 1, :, span], k[r:r + 1, :, span],
                                                        v[r:r + 1, :, span], is_causal=True))
            start += doc
        if start < length:
            parts.append(q.new_zeros(1, q.shape[1], length - start, q.shape[3]))
        out.append(torch.cat(parts, dim=2))
    return torch.cat(out, dim=0)


def document_positions(rows: Rows, length: int, device: torch.device) -> torch.Tensor:
    """``[rows, length]`` positions that restart at 0 at each document (0 on padding)."""
    positions = torch.zeros(len(rows), length, dtype=torch.int64)
    for r, lengths in enumerate(rows):
        start = 0
        for doc in lengths:
            positions[r, start:start + doc] = torch.arange(doc)
            start += doc
    return positions.to(device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        batch, length, d_model = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, d_model // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, head_dim]
        if rows is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = document_attention(q, k, v, rows)
        return self.proj(out.transpose(1, 2).reshape(batch, length, d_model))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` with a 4x GELU MLP."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rows)
        return x + self.mlp(self.mlp_norm(x))


class ByteEmbedding(nn.Module):
    """Token + learned position embedding, ``[B, L]`` byte ids -> ``[B, L, d_model]``.

    The first layer of :meth:`ByteTransformer.pipeline_layers`; it shares the model's tables.
    """

    def __init__(self, token_embedding: nn.Embedding, position_embedding: nn.Embedding) -> None:
        super().__init__()
        self.token_embedding = token_embedding
        self.position_embedding = position_embedding

    def forward(self, tokens: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.position_embedding.num_embeddings:
            raise ValueError(
                f"input of {length} bytes exceeds max_seq_len={self.position_embedding.num_embeddings}"
            )
        if rows is None:
            positions = torch.arange(length, device=tokens.device)
        else:
            positions = document_positions(rows, length, tokens.device)
        return self.token_embedding(tokens) + self.position_embedding(positions)


class OutputHead(nn.Module):
    """Final LayerNorm and the byte head, ``[B, L, d_model]`` -> ``[B, L, 256]`` logits.

    The last layer of :meth:`ByteTransformer.pipeline_layers`; it shares the model's modules.
    """

    def __init__(self, final_norm: nn.LayerNorm, head: nn.Linear) -> None:
        super().__init__()
        self.final_norm = final_norm
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.final_norm(x))


class ByteTransformer(nn.Module):
    """Decoder-only byte language model: ``[B, L]`` byte ids -> ``[B, L, 256]`` logits.

    The head is not tied to the token embedding, so a pipeline split can put the
    embedding and the head on different stages without sharing a parameter.

    Args:
        max_seq_len: longest input in bytes (size of the learned position table).
        d_model: width of the residual stream.
        num_layers: number of transformer blocks (``self.blocks``).
        num_heads: attention heads per block; must divide ``d_model``.
    """

    def __init__(self, *, max_seq_len: int, d_model: int, num_layers: int, num_heads: int):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_embedding = nn.Embedding(VOCAB_SIZE, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, num_heads) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE)
        self.apply(_init_weights)

    def pipeline_layers(self) -> list[nn.Module]:
        """The forward pass as layers applied one after the other, sharing this model's
        parameters: the embedding, every block, the output head. A pipeline cuts between them.

        (Built on demand rather than stored, so the state dict keeps one name per tensor.)
        """
        return [
            ByteEmbedding(self.token_embedding, self.position_embedding),
            *self.blocks,
            OutputHead(self.final_norm, self.head),
        ]

    def forward(self, tokens: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        """Logits of ``tokens``; with ``rows`` (packed rows: :attr:`Batch.rows`), attention per
        document and positions restarting at each."""
        if rows is None:
            x = tokens
            for layer in self.pipeline_layers():
                x = layer(x)
            return x
        x = ByteEmbedding(self.token_embedding, self.position_embedding)(tokens, rows)
        for block in self.blocks:
            x = block(x, rows)
        return self.head(self.final_norm(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def code_lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy (nats) over the batch's real target bytes (packed rows whose pieces
    have no target, all of one byte: 0, not the NaN of a mean over nothing)."""
    if batch.rows is None:
        return F.cross_entropy(
            model(batch.inputs).reshape(-1, VOCAB_SIZE), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX
        )
    targets = batch.targets.reshape(-1)
    total = F.cross_entropy(model(batch.inputs, batch.rows).reshape(-1, VOCAB_SIZE), targets,
                            ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def code_lm_eval_sums(model: nn.Module, batch: Batch) -> EvalSums:
    """Summed cross-entropy (nats), arg-max hits and count over real target bytes."""
    logits = (model(batch.inputs) if batch.rows is None else model(batch.inputs, batch.rows)).reshape(-1, VOCAB_SIZE)
    targets = batch.targets.reshape(-1)
    real = targets != IGNORE_INDEX
    loss_sum = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(dim=-1) == targets) & real).sum()
    # .item() synchronises with the device; eval runs rarely, so one sync per batch is fine.
    return EvalSums(
        loss_sum=float(loss_sum.item()),
        correct=float(correct.item()),
        count=float(real.sum().item()),
    )


# --------------------------------------------------------------------------- builder


def _check_positive(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"code-lm {name}={value!r} is invalid; need an integer >= {minimum}")


def build_code_lm_task(
    *,
    max_seq_len: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    cache_dir: Path,
    seed: int,
    packed: bool = False,
) -> Task:
    """Build the ``code-lm`` task (loads or builds the corpus cache in ``cache_dir``).

    Args:
        max_seq_len: bytes per sample after truncation (>= 16); also the position table size.
        d_model: model width (>= 1, divisible by ``num_heads``).
        num_layers: transformer blocks (>= 1).
        num_heads: attention heads (>= 1).
        cache_dir: where the corpus index is cached.
        seed: seeds the model initialisation only; the data split never depends on it.
        packed: train on whole documents packed into rows of ``max_seq_len`` bytes, attention
            per document (see module doc); held-out samples are truncated as unpacked.

    Raises:
        ValueError: an argument is out of range.
    """
    _check_positive("max_seq_len", max_seq_len, 16)
    _check_positive("d_model", d_model, 1)
    _check_positive("num_layers", num_layers, 1)
    _check_positive("num_heads", num_heads, 1)
    if d_model % num_heads:
        raise ValueError(
            f"code-lm d_model={d_model} is not divisible by num_heads={num_heads}; "
            "choose num_heads that divides d_model"
        )
    corpus = load_corpus(cache_dir)
    train_set, eval_set = make_datasets(corpus, max_seq_len)
    if packed:  # whole documents: the sampler cuts the long ones into pieces of a row
        train, _ = split_indices(corpus)
        train_set = ByteSampleDataset(corpus.blob, corpus.offsets[train], corpus.lengths[train].astype(np.int64))

    def build_model() -> nn.Module:
        # Fork the CPU RNG (only: forking every device RNG is slow) so building a model
        # neither depends on nor disturbs the caller's global random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return ByteTransformer(
                max_seq_len=max_seq_len,
                d_model=d_model,
                num_layers=num_layers,
                num_heads=num_heads,
            )

    return Task(
        name="code-lm",
        train_set=train_set,
        eval_set=eval_set,
        train_lengths=train_set.lengths.copy(),
        train_targets=train_set.lengths - 1,  # every byte but the first is predicted
        # FLOPs per token: ~24·d² in the linear layers, ~4·L·d in attention -> α ≈ 1/(6·d).
        cost_alpha=1.0 / (6.0 * d_model),
        build_model=build_model,
        collate=functools.partial(collate_packed, row_tokens=max_seq_len) if packed else collate_bytes,
        train_loss=code_lm_loss,
        eval_sums=code_lm_eval_sums,
        loss_unit="bits/byte",
        default_batch_size=8,
        default_lr=1e-3,
        row_tokens=max_seq_len if packed else None,
    )
