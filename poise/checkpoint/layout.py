"""The on-disk layout of checkpoints: names, manifests, verification, composing differentials.

One directory per checkpoint under the root, named by the step it was taken after::

    <root>/step-00000040/
        model.pt        rank 0: model tensors stored in this checkpoint (all, or the changed ones)
        optim.pt        rank 0: optimizer tensors, likewise
        state.pt        rank 0: everything else every rank shares (step, scheduler, data position...)
        rank-00001.pt   each rank: what differs per rank (RNG states, error-feedback residuals...)
        manifest.json   written last: size and sha256 of every file, where each tensor lives

While it is written the directory is ``.partial-step-00000040-<token>``, ``<token>`` unique to
the job's launcher attempt; it is renamed to its final name after the manifest is on disk
(fsync'd), so a checkpoint directory without the ``.partial`` prefix is always complete. A
manifest is input like any file on disk: :func:`read_manifest` bounds its size and nesting
before parsing it and checks its shape (plain file names inside the folder, bases named
``step-NNNNNNNN``) before anything acts on it. No symbolic link in a checkpoint is followed: a
linked folder, manifest or file makes the checkpoint not good. A partial folder is never a
checkpoint; the job that takes the root's lock removes the ones earlier saves left unfinished.

The root holds ``.lock``, locked (``flock``) by the job's rank 0 for as long as it runs (taken
before a resume picks its checkpoint), so two jobs never write, prune or set aside in one
directory. Folders a resume passed over (newer than the checkpoint it resumed from, none of
them verifying or loading) are renamed ``.aside-step-...-<token>``
and never deleted by poise; ``.old-step-...`` is a checkpoint being replaced by a newer save
of the same step, renamed back if a crash came in between. Everything that changes the root
(writing, renaming into place, the lock, recovering, setting aside, pruning) is in
:mod:`poise.checkpoint.directory`; this module names and reads. ``.pt`` files are read with
``torch.load(weights_only=True)``: only tensors and plain containers, never code.

A *differential* checkpoint stores only the tensors whose sha256 changed since the previous
checkpoint; its manifest's ``tensors`` table names, for every tensor, the checkpoint whose
files hold it (itself or an earlier one) and its hash. Loading composes them and checks each
tensor's hash, so a restore is bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

import torch

from poise.comm import codecs

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# A checkpoint folder's final name: step-NNNNNNNN.
NAME_PATTERN = re.compile(r"^step-(\d{8})$")
# A file of a checkpoint: a plain name inside its folder (no separators, no leading dot).
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
LOCK = ".lock"
PARTIAL_PREFIX = ".partial-"
ASIDE_PREFIX = ".aside-"
OLD_PREFIX = ".old-"
# Bounds on a manifest read before it is parsed: a crafted one must not exhaust memory or
# recursion. A manifest lists every tensor (~200 bytes each) and nests 5 levels deep.
MAX_MANIFEST_BYTES = 64 << 20
MAX_MANIFEST_DEPTH = 16
# The most ranks a checkpoint may name (as many as poise plans for): a world size is looped
# over (one file per rank) before anything else is read, so a crafted one must be bounded.
MAX_WORLD_SIZE = 1 << 20
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


# The manifest's own checksum: sha256 of its canonical JSON without this key (:func:`sealed`).
# It tells a manifest damaged after it was written (a flipped setting would otherwise read as
# another run's config, stopping the job instead of falling back) from the one the save wrote;
# manifests written before it have none and are read as before.
SEAL = "manifest_sha256"


def seal_of(manifest: dict[str, Any]) -> str:
    """The checksum :data:`SEAL` holds for ``manifest`` (whatever it holds under that key now)."""
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """``manifest`` as JSON gives it back (tuples as lists, keys as strings) with its checksum
    under :data:`SEAL`: what a reader parses is what was sealed."""
    plain = json.loads(json.dumps(manifest))
    return {**plain, SEAL: seal_of(plain)}


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files are missing, truncated or do not match their checksums."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_name(step: int, token: str) -> str:
    """The folder a save of ``step`` is written in; ``token`` is unique to one launcher attempt
    of one job (:func:`new_token`), so no two writers ever share a partial folder."""
    return f"{PARTIAL_PREFIX}{checkpoint_name(step)}-{token}"


def new_token() -> str:
    """A fresh writer token for :func:`partial_name` (16 hex digits)."""
    return secrets.token_hex(8)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes, with its dtype and shape (equal digests: equal tensors)."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories (final names), newest first: ``(step, path)``.

    A symbolic link with a checkpoint's name is listed too (``poise checkpoint list`` shows it),
    but never verifies (:func:`read_manifest`).
    """
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := NAME_PATTERN.match(p.name)) and (p.is_dir() or p.is_symlink())]
    return sorted(found, reverse=True)


def open_nofollow(path: Path) -> Any:
    """Open a checkpoint's file for reading, refusing a symbolic link (the manifest names files
    inside the folder; a link would read one outside it, which docs/checkpoints.md calls not good).

    Raises:
        CorruptCheckpoint: ``path`` is a symbolic link. OSError: it cannot be opened.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if path.is_symlink():
            raise CorruptCheckpoint(f"{path.parent.name}/{path.name} is a symbolic link, not a file of the "
                                    "checkpoint") from None
        raise exc from None
    return os.fdopen(fd, "rb")


def json_depth_problem(data: bytes, max_depth: int) -> str:
    """Why JSON text ``data`` nests deeper than ``max_depth`` arrays/objects ('' when it does not).

    Counted without parsing (strings removed first), so that a crafted file cannot reach the
    parser's recursion limit.
    """
    import numpy as np  # imported here: poise.checkpoint's importers need not load numpy for this

    codes = np.frombuffer(_JSON_STRING.sub(b"", data), dtype=np.uint8)
    if not codes.size:
        return ""
    step = (np.isin(codes, (ord("["), ord("{"))).astype(np.int64)
            - np.isin(codes, (ord("]"), ord("}"))).astype(np.int64))
    deepest = int(np.cumsum(step).max())
    return f"it nests {deepest} levels deep (at most {max_depth})" if deepest > max_depth else ""


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its size and depth bounded before parsing and its
    shape checked (:func:`manifest_problem`); neither the folder nor the manifest may be a link.

    Raises:
        CorruptCheckpoint: it is missing, unreadable, too large or deep, or not shaped like a manifest.
    """
    if path.is_symlink():
        raise CorruptCheckpoint(f"{path.name} is a symbolic link, not a checkpoint folder")
    try:
        with open_nofollow(path / MANIFEST) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES >> 20} MiB")
        too_deep = json_depth_problem(data, MAX_MANIFEST_DEPTH)
        if too_deep:
            raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is malformed: {too_deep}")
        manifest = json.loads(data)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, CorruptCheckpoint):
            raise
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{path.name}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    problem = manifest_problem(path.name, manifest)
    if problem:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is malformed: {problem}")
    if SEAL in manifest and manifest[SEAL] != seal_of(manifest):
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} does not match its own checksum (changed after it was "
                                "written)")
    return manifest


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def manifest_problem(name: str, manifest: dict[str, Any]) -> str:
    """What is wrong with the shape of checkpoint ``name``'s manifest ('' when nothing).

    Checked: ``step`` (the folder's), ``kind``, ``world_size`` (at most :data:`MAX_WORLD_SIZE`
    and the number of files); ``files``: plain names inside
    the folder, each with ``bytes`` and ``sha256``; ``bases``: names ``step-NNNNNNNN`` including
    this one; ``tensors``: per group, entries whose ``in`` and deltas' ``in`` are among the
    bases; and the fit-check fields (``config``, ``config_hash``, ``params``).
    """
    match = NAME_PATTERN.match(name)
    step = manifest.get("step")
    if not _is_int(step, 0) or (match is not None and int(match.group(1)) != step):
        return f"step {step!r} is not this folder's"
    if manifest.get("kind") not in ("full", "differential"):
        return f"kind {manifest.get('kind')!r} is not full or differential"
    world = manifest.get("world_size")
    if not _is_int(world, 1) or world > MAX_WORLD_SIZE:
        return f"world_size {str(world)[:40]} is not a number of ranks from 1 to {MAX_WORLD_SIZE}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a non-empty object"
    if world > len(files):  # every rank writes a file: a larger world is not this checkpoint's
        return f"world_size {world} is more than the {len(files)} files it lists (one per rank at least)"
    for file, entry in files.items():
        if not _FILE_NAME.match(file):
            return f"file name {file!r} is not a plain name inside the folder"
        if not isinstance(entry, dict) or not _is_int(entry.get("bytes"), 0) \
                or not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"]):
            return f"file {file!r} lacks bytes or sha256"
    bases = manifest.get("bases")
    if not isinstance(bases, list) or not all(isinstance(b, str) and NAME_PATTERN.match(b) for b in bases):
        return "bases is not a list of names step-NNNNNNNN"
    if match is not None and name not in bases:
        return "bases does not include the checkpoint itself"
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or set(tensors) != {"model", "optim"}:
        return "tensors is not an object of the groups model and optim"
    for group, table in tensors.items():
        if not isinstance(table, dict):
            return f"tensors.{group} is not an object"
        for key, entry in table.items():
            deltas = entry.get("deltas", []) if isinstance(entry, dict) else None
            if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) or not isinstance(deltas, list) \
                    or not all(isinstance(d, dict) and isinstance(d.get("codec"), str) for d in deltas):
                return f"tensor {group}/{key} has a malformed entry"
            if any(h not in bases for h in [entry.get("in"), *(d.get("in") for d in deltas)]):
                return f"tensor {group}/{key} is held by a checkpoint outside bases"
    if not isinstance(manifest.get("config"), dict) or not isinstance(manifest.get("params"), dict) \
            or not isinstance(manifest.get("config_hash"), str):
        return "config, params or config_hash is missing"
    return ""


def _verify_files(path: Path, manifest: dict[str, Any]) -> None:
    check_files(path, manifest["files"])


def check_files(path: Path, files: dict[str, dict[str, Any]]) -> None:
    """Check that every file of ``files`` (name -> ``bytes`` and ``sha256``) is in folder ``path``,
    a regular file (no link) of that size and checksum.

    Raises:
        CorruptCheckpoint: naming the first that is missing, a link, truncated or altered.
    """
    for name, entry in files.items():
        file = path / name
        if file.is_symlink():
            raise CorruptCheckpoint(f"{path.name}/{name} is a symbolic link, not a file of the checkpoint")
        if not file.is_file():
            raise CorruptCheckpoint(f"{path.name}/{name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CorruptCheckpoint(f"{path.name}/{name} has {size} bytes, the manifest says {entry['bytes']}")
        digest = hashlib.sha256()
        with open_nofollow(file) as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        if digest.hexdigest() != entry["sha256"]:
            raise CorruptCheckpoint(f"{path.name}/{name} does not match its checksum")


def verify(root: Path, name: str) -> dict[str, Any]:
    """Check every file of checkpoint ``name`` and of the earlier ones it builds on; return its manifest.

    Raises:
        CorruptCheckpoint: naming the first file that is missing, truncated or altered.
    """
    manifest = read_manifest(root / name)
    _verify_files(root / name, manifest)
    for base in sorted(set(manifest["bases"]) - {name}):
        if (root / base).is_symlink():
            raise CorruptCheckpoint(f"{name} builds on {base}, which is a symbolic link")
        if not (root / base).is_dir():
            raise CorruptCheckpoint(f"{name} builds on {base}, which is missing")
        _verify_files(root / base, read_manifest(root / base))
    return manifest


def newest_good(root: Path) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint that verifies, warning once per one skipped; None if there is none."""
    for _, path in list_checkpoints(root):
        try:
            return path.name, verify(root, path.name)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint %s: %s; trying the previous one", path.name, exc)
    return None


def load_file(path: Path) -> Any:
    """Read a checkpoint file: tensors and plain containers only (``weights_only``), never
    through a symbolic link."""
    with open_nofollow(path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def holders(entry: dict[str, Any]) -> list[str]:
    """The checkpoints a manifest entry reads from: where its tensor is, then its deltas, in order."""
    return [entry["in"], *(d["in"] for d in entry.get("deltas", ()))]


def load_tensors(root: Path, manifest: dict[str, Any], group: str) -> dict[str, torch.Tensor]:
    """Compose the tensors of ``group`` (``model`` or ``optim``) from the checkpoints that hold them:
    each tensor as it was stored, plus the decoded deltas saved after it (lossy ``delta_codec``).

    Raises:
        CorruptCheckpoint: when a tensor or delta is missing or a stored tensor's hash differs
            from the manifest's (deltas are covered by their files' checksums).
    """
    table: dict[str, dict[str, Any]] = manifest["tensors"][group]
    files: dict[str, dict[str, Any]] = {}
    decoders: dict[str, codecs.Codec] = {}

    def stored(holder: str, key: str) -> Any:
        if holder not in files:
            files[holder] = load_file(root / holder / f"{group}.pt")
            if not isinstance(files[holder], dict):
                raise CorruptCheckpoint(f"{holder}/{group}.pt holds a {type(files[holder]).__name__}, not a "
                                        "table of tensors")
        if key not in files[holder]:
            raise CorruptCheckpoint(f"{holder}/{group}.pt lacks {key}")
        return files[holder][key]

    out: dict[str, torch.Tensor] = {}
    for key, entry in table.items():
        tensor = stored(entry["in"], key)
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpoint(f"{entry['in']}/{group}.pt: {key} is a {type(tensor).__name__}, not a tensor")
        if tensor_digest(tensor) != entry["sha256"]:
            raise CorruptCheckpoint(f"{entry['in']}/{group}.pt: {key} does not match its hash")
        for delta in entry.get("deltas", ()):
            payload = codecs.Encoded(tuple(stored(delta["in"], key)), tensor.shape, tensor.dtype)
            if delta["codec"] not in decoders:
                decoders[delta["codec"]] = codecs.make(delta["codec"])
            tensor = tensor + decoders[delta["codec"]].decode(payload)
        out[key] = tensor
    return out
