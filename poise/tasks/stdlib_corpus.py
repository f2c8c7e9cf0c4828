"""The stdlib corpus behind ``code-lm``: every top-level definition of the standard library.

This module finds the running interpreter's standard library, extracts every top-level
definition (function, async function, class, with its decorators) from its ``.py`` files,
tests included, caches the result, and splits it train/validation by file. Real source is
used because its lengths are long-tailed (about 1,800 files and 12,600 samples, median
about 470 bytes, p99 about 27 kB), which is exactly what cost-aware sharding has to
balance and what synthetic data would not exercise. Parsing the stdlib takes seconds, so
it is indexed once into a cache (one uint8 blob plus a JSON index) keyed on the stdlib
path, Python version and file stats; every rank shares that cache, so both files are
written atomically (a reader sees the old file or the complete new one) and verified by
sha256 on load, and a corrupt or stale cache is rebuilt rather than trusted.
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
import time
import tokenize
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from poise.files import write_atomic

logger = logging.getLogger(__name__)

VALIDATION_PER_MILLE = 50
"""Files whose path hash falls in the first 50 of 1,000 buckets (5 %) are held out."""

_CACHE_FORMAT = 1
_BLOB_NAME = "code_lm_blob.npy"
_INDEX_NAME = "code_lm_index.json"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_DEFINITION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
MIN_SAMPLE_BYTES = 2  # one input byte and one target byte


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
                if len(definition) >= MIN_SAMPLE_BYTES:
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
    write_atomic(cache_dir / _BLOB_NAME, lambda h: np.save(h, corpus.blob))
    write_atomic(cache_dir / _INDEX_NAME, lambda h: h.write(json.dumps(index).encode()))


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
        or lengths.min() < MIN_SAMPLE_BYTES
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
