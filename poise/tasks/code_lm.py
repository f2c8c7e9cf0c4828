"""The ``code-lm`` task: a byte-level transformer language model on real Python source.

The corpus is every top-level definition (function, async function, class, with its
decorators) in the ``.py`` files of the running interpreter's standard library, tests
included: about 1,800 files and 12,600 samples whose lengths are heavy-tailed (median about
470 bytes, p99 about 27 kB). That skew is the point: it is what cost-aware sharding has to
balance. The corpus is indexed once into a cache (one uint8 blob plus a JSON index, written
atomically and verified by sha256 on load), split train/validation by a hash of each file's
path, and truncated to ``max_seq_len`` bytes per sample at load time. The model is a small
pre-LN decoder-only transformer over the 256 byte values whose blocks live in
``model.blocks`` so that a pipeline can cut between them.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import io
import json
import logging
import os
import sys
import sysconfig
import tempfile
import time
import tokenize
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from poise.tasks.base import IGNORE_INDEX, Batch, EvalSums, Task

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
"""Byte values; every token id is one byte."""

VALIDATION_PER_MILLE = 50
"""Files whose path hash falls in the first 50 of 1,000 buckets (5 %) are held out."""

_CACHE_FORMAT = 1
_BLOB_NAME = "code_lm_blob.npy"
_INDEX_NAME = "code_lm_index.json"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_DEFINITION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_MIN_SAMPLE_BYTES = 2  # one input byte and one target byte


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True, eq=False)  # numpy fields have no boolean ==
class Corpus:
    """All top-level definitions of the stdlib, as one byte blob plus a per-sample index.

    Attributes:
        stdlib_root: absolute path of the indexed standard library.
        paths: file paths relative to ``stdlib_root`` (POSIX form) of every parsed file.
        blob: uint8 array, all samples' bytes concatenated.
        file_ids: int64 per sample, index into ``paths``.
        offsets: int64 per sample, byte offset of the sample in ``blob``.
        lengths: int64 per sample, full (untruncated) length in bytes.
        from_cache: True when this corpus was read from a valid cache, False when the
            stdlib was walked and parsed.
    """

    stdlib_root: str
    paths: tuple[str, ...]
    blob: np.ndarray
    file_ids: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    from_cache: bool

    @property
    def num_samples(self) -> int:
        return len(self.lengths)


class _CacheInvalid(Exception):
    """The cache exists but cannot be used; the message says why."""


def stdlib_root() -> Path:
    """Return the running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _list_source_files(root: Path) -> list[tuple[str, Path, os.stat_result]]:
    """Return ``(relative posix path, absolute path, stat)`` for every stdlib ``.py`` file.

    Sorted, so the index (and therefore the blob bytes) is the same on every rank and run.
    Third-party packages under ``site-packages``/``dist-packages`` are not stdlib and are
    skipped; symlinked directories are not followed.
    """
    found = []
    for dir_path, dir_names, file_names in os.walk(root):
        dir_names[:] = sorted(d for d in dir_names if d not in _EXCLUDED_DIRS)
        for name in sorted(file_names):
            if name.endswith(".py"):
                path = Path(dir_path) / name
                found.append((path.relative_to(root).as_posix(), path, path.stat()))
    return found


def _cache_key(root: Path, files: Sequence[tuple[str, Path, os.stat_result]]) -> str:
    """Hash of everything the index depends on: stdlib path, Python version, file stats."""
    digest = hashlib.sha256()
    header = f"{_CACHE_FORMAT}\0{root}\0{sys.version}\0"
    digest.update(header.encode())
    for rel, _, stat in files:
        digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _line_starts(source: bytes) -> list[int]:
    """Byte offset of the start of each line (index 0 is line 1), as ast numbers them.

    ``bytes.splitlines`` breaks only on ``\\n``, ``\\r\\n`` and ``\\r``, the same line ends
    the tokenizer uses (unlike ``str.splitlines``, which also breaks on form feeds).
    """
    starts = [0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def extract_definitions(source: bytes) -> list[bytes]:
    """Return the UTF-8 bytes of every top-level definition in ``source``, decorators included.

    Args:
        source: contents of a Python file in its declared encoding (PEP 263).

    Returns:
        One ``bytes`` per top-level ``def``/``async def``/``class``, in file order, as the
        exact UTF-8 encoding of the source text.

    Raises:
        SyntaxError, ValueError, UnicodeDecodeError: the file does not decode or parse.
    """
    # ast columns are offsets into the UTF-8 encoding of each line, whatever the file's
    # declared encoding, so decode per the cookie and index the UTF-8 re-encoding
    # (this also drops a BOM, which the tokenizer would not count either).
    encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    text = source.decode(encoding)
    with warnings.catch_warnings():
        # Old stdlib test files have invalid escapes; the warnings say nothing about us.
        warnings.simplefilter("ignore", category=SyntaxWarning)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        tree = ast.parse(text)
    source = text.encode("utf-8")
    starts = _line_starts(source)
    definitions = []
    for node in tree.body:
        if not isinstance(node, _DEFINITION_TYPES):
            continue
        # ast column offsets are UTF-8 byte offsets, so line start + column is a byte offset.
        if node.decorator_list:
            first = node.decorator_list[0]
            expr_start = starts[first.lineno - 1] + first.col_offset
            # The decorator node starts after its '@' (which may sit on an earlier line
            # behind a backslash continuation), so walk back to the '@'.
            begin = source.rindex(b"@", 0, expr_start)
        else:
            begin = starts[node.lineno - 1] + node.col_offset
        assert node.end_lineno is not None and node.end_col_offset is not None
        end = starts[node.end_lineno - 1] + node.end_col_offset
        definitions.append(source[begin:end])
    return definitions


def _build_corpus(root: Path, files: Sequence[tuple[str, Path, os.stat_result]]) -> Corpus:
    """Parse every file and collect its definitions (the slow path, seconds)."""
    paths: list[str] = []
    chunks: list[bytes] = []
    file_ids: list[int] = []
    num_skipped = 0
    # ast.parse allocates millions of acyclic nodes, which trigger full collections over
    # everything torch has loaded; pausing the collector halves indexing time.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for rel, path, _ in files:
            try:
                definitions = extract_definitions(path.read_bytes())
            except (SyntaxError, ValueError, UnicodeDecodeError, OSError) as exc:
                logger.debug("code-lm: skipping %s (%s)", rel, type(exc).__name__)
                num_skipped += 1
                continue
            file_id = len(paths)
            paths.append(rel)
            for definition in definitions:
                if len(definition) >= _MIN_SAMPLE_BYTES:
                    chunks.append(definition)
                    file_ids.append(file_id)
    finally:
        if gc_was_enabled:
            gc.enable()
    logger.debug("code-lm: %d of %d stdlib files failed to parse", num_skipped, len(files))
    if not chunks:
        raise RuntimeError(f"code-lm found no top-level definitions under {root}")
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    blob = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    return Corpus(
        stdlib_root=str(root),
        paths=tuple(paths),
        blob=blob,
        file_ids=np.array(file_ids, dtype=np.int64),
        offsets=offsets,
        lengths=lengths,
        from_cache=False,
    )


def _write_atomically(target: Path, write: Any) -> None:
    """Write via a temp file in the same directory, fsync, then ``os.replace``, so readers
    (other ranks sharing the cache) see the old file or the complete new one, never a part."""
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            # mkstemp creates 0600; the cache may be shared by ranks running as other users.
            os.fchmod(handle.fileno(), 0o644)
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _save_cache(cache_dir: Path, corpus: Corpus, key: str) -> None:
    cache_dir.mkdir(parents=True, exist_ok=True)
    index = {
        "format": _CACHE_FORMAT,
        "key": key,
        "stdlib_root": corpus.stdlib_root,
        "python_version": sys.version,
        "blob_sha256": hashlib.sha256(corpus.blob.data).hexdigest(),
        "blob_nbytes": int(corpus.blob.nbytes),
        "paths": list(corpus.paths),
        "file_ids": corpus.file_ids.tolist(),
        "offsets": corpus.offsets.tolist(),
        "lengths": corpus.lengths.tolist(),
    }
    # Blob first: an index on disk always names a blob that is already complete.
    _write_atomically(cache_dir / _BLOB_NAME, lambda h: np.save(h, corpus.blob))
    _write_atomically(cache_dir / _INDEX_NAME, lambda h: h.write(json.dumps(index).encode()))


def _load_cache(cache_dir: Path, key: str) -> Corpus:
    """Read and verify the cache; raise ``_CacheInvalid`` if it is corrupt or stale."""
    try:
        index = json.loads((cache_dir / _INDEX_NAME).read_bytes())
        if index.get("format") != _CACHE_FORMAT or index.get("key") != key:
            raise _CacheInvalid("built for a different stdlib, Python version or format")
        blob = np.load(cache_dir / _BLOB_NAME, allow_pickle=False)
        file_ids = np.asarray(index["file_ids"], dtype=np.int64)
        offsets = np.asarray(index["offsets"], dtype=np.int64)
        lengths = np.asarray(index["lengths"], dtype=np.int64)
        paths = tuple(str(p) for p in index["paths"])
        stored_sha = index["blob_sha256"]
    except _CacheInvalid:
        raise
    except (ValueError, KeyError, TypeError, OSError, EOFError) as exc:
        raise _CacheInvalid(f"unreadable ({type(exc).__name__}: {exc})") from exc
    if blob.dtype != np.uint8 or blob.ndim != 1:
        raise _CacheInvalid(f"blob has dtype {blob.dtype} and shape {blob.shape}, want 1-D uint8")
    if hashlib.sha256(blob.data).hexdigest() != stored_sha:
        raise _CacheInvalid("blob sha256 does not match the index")
    if not (len(file_ids) == len(offsets) == len(lengths)):
        raise _CacheInvalid("index arrays have different lengths")
    if len(lengths) and (
        offsets.min() < 0
        or lengths.min() < _MIN_SAMPLE_BYTES
        or (offsets + lengths).max() > blob.shape[0]
        or file_ids.min() < 0
        or file_ids.max() >= len(paths)
    ):
        raise _CacheInvalid("index points outside the blob or the file list")
    return Corpus(
        stdlib_root=str(index["stdlib_root"]),
        paths=paths,
        blob=blob,
        file_ids=file_ids,
        offsets=offsets,
        lengths=lengths,
        from_cache=True,
    )


def load_corpus(cache_dir: Path) -> Corpus:
    """Return the stdlib definition corpus, parsing the stdlib only if no valid cache exists.

    The cache key covers the stdlib path, the Python version and every file's relative
    path, size and mtime, so an interpreter upgrade rebuilds it. A corrupt or mismatched
    cache is logged as one warning and rebuilt; concurrent builders write identical bytes.

    Args:
        cache_dir: directory for ``code_lm_blob.npy`` and ``code_lm_index.json``; created
            if missing.

    Returns:
        The corpus; ``corpus.from_cache`` says whether the parse was skipped.
    """
    cache_dir = Path(cache_dir)
    root = stdlib_root()
    files = _list_source_files(root)
    key = _cache_key(root, files)
    start_s = time.perf_counter()
    if (cache_dir / _INDEX_NAME).exists():
        try:
            corpus = _load_cache(cache_dir, key)
        except _CacheInvalid as exc:
            logger.warning("code-lm cache in %s is unusable (%s); rebuilding it", cache_dir, exc)
        else:
            elapsed_s = time.perf_counter() - start_s
            logger.debug(
                "code-lm: loaded %d samples from cache in %.3f s", len(corpus.lengths), elapsed_s
            )
            return corpus
    corpus = _build_corpus(root, files)
    _save_cache(cache_dir, corpus, key)
    elapsed_s = time.perf_counter() - start_s
    logger.info(
        "code-lm: indexed %d samples from %d stdlib files in %.2f s into %s",
        len(corpus.lengths),
        len(corpus.paths),
        elapsed_s,
        cache_dir,
    )
    return corpus


def is_validation_file(relative_path: str) -> bool:
    """Whether a file (path relative to the stdlib root, POSIX form) is held out.

    A pure function of the path, so the split is the same on every rank, run and machine
    and never splits one file's definitions across train and validation.
    """
    bucket = int(hashlib.sha1(relative_path.encode()).hexdigest()[:8], 16) % 1000
    return bucket < VALIDATION_PER_MILLE


def split_indices(corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(train, validation)`` sample indices (int64, ascending) split by file."""
    held_out_files = np.array([is_validation_file(p) for p in corpus.paths], dtype=bool)
    held_out = held_out_files[corpus.file_ids]
    return np.flatnonzero(~held_out).astype(np.int64), np.flatnonzero(held_out).astype(np.int64)


def corpus_stats(corpus: Corpus, max_seq_len: int = 1024) -> dict[str, float | int]:
    """Summary numbers for reports.

    Returns:
        ``num_files`` (parsed files), ``num_samples``, ``blob_bytes``, ``median_bytes`` and
        ``p99_bytes`` (full sample length, bytes), ``max_bytes``, and ``fraction_at_cap``
        (share of samples with at least ``max_seq_len`` bytes, i.e. truncated to the cap).
    """
    lengths = corpus.lengths
    return {
        "num_files": len(corpus.paths),
        "num_samples": corpus.num_samples,
        "blob_bytes": int(corpus.blob.nbytes),
        "median_bytes": float(np.median(lengths)),
        "p99_bytes": float(np.percentile(lengths, 99)),
        "max_bytes": int(lengths.max()),
        "fraction_at_cap": float(np.mean(lengths >= max_seq_len)),
    }


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
    if int(lengths.min()) < _MIN_SAMPLE_BYTES:
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
    )


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, d_model // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, L, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"input of {length} bytes exceeds max_seq_len={self.max_seq_len}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def code_lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy (nats) over the batch's real target bytes."""
    logits = model(batch.inputs)
    return F.cross_entropy(
        logits.reshape(-1, VOCAB_SIZE), batch.targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def code_lm_eval_sums(model: nn.Module, batch: Batch) -> EvalSums:
    """Summed cross-entropy (nats), arg-max hits and count over real target bytes."""
    logits = model(batch.inputs).reshape(-1, VOCAB_SIZE)
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
) -> Task:
    """Build the ``code-lm`` task (loads or builds the corpus cache in ``cache_dir``).

    Args:
        max_seq_len: bytes per sample after truncation (>= 16); also the position table size.
        d_model: model width (>= 1, divisible by ``num_heads``).
        num_layers: transformer blocks (>= 1).
        num_heads: attention heads (>= 1).
        cache_dir: where the corpus index is cached.
        seed: seeds the model initialisation only; the data split never depends on it.

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
        build_model=build_model,
        collate=collate_bytes,
        train_loss=code_lm_loss,
        eval_sums=code_lm_eval_sums,
        loss_unit="bits/byte",
        default_batch_size=8,
        default_lr=1e-3,
    )
