"""The on-disk layout of checkpoints: files, manifests, verification, composing differentials.

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
manifest is input like any file on disk: :func:`read_manifest` checks its shape (plain file
names inside the folder, bases named ``step-NNNNNNNN``) before anything acts on it.

The root holds ``.lock``, locked (``flock``) by the job's rank 0 for as long as it runs, so two
jobs never write, or prune, one directory. Folders a resume passed over (newer than the
checkpoint it resumed from, none of them verifying) are renamed ``.aside-step-...-<token>``
and never deleted by poise; ``.old-step-...`` is a checkpoint being replaced by a newer save
of the same step, renamed back by :func:`recover` if a crash came in between. ``.pt`` files are read with
``torch.load(weights_only=True)``: only tensors and plain containers, never code.

A *differential* checkpoint stores only the tensors whose sha256 changed since the previous
checkpoint; its manifest's ``tensors`` table names, for every tensor, the checkpoint whose
files hold it (itself or an earlier one) and its hash. Loading composes them and checks each
tensor's hash, so a restore is bit-exact.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poise.comm import codecs
from poise.files import write_atomic, write_json_atomic

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d{8})$")
# A file of a checkpoint: a plain name inside its folder (no separators, no leading dot).
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
LOCK = ".lock"
PARTIAL_PREFIX = ".partial-"
ASIDE_PREFIX = ".aside-"
OLD_PREFIX = ".old-"


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


@dataclass(frozen=True)
class WrittenFile:
    """A file of a checkpoint: name, size in bytes, sha256."""

    name: str
    bytes: int
    sha256: str

    def entry(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "sha256": self.sha256}


def write_payload(directory: Path, name: str, payload: Any) -> WrittenFile:
    """``torch.save`` ``payload`` to ``directory/name`` atomically; return its size and checksum."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getbuffer()
    # never recreate a checkpoint folder someone removed: the save fails instead
    write_atomic(directory / name, lambda h: h.write(data), make_parents=False)
    return WrittenFile(name, len(data), hashlib.sha256(data).hexdigest())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(root: Path, partial: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Write the manifest into ``partial`` and rename it to the checkpoint's final name.

    The same step saved by an earlier attempt is replaced (the newer one wins) in three
    steps, so that a crash at any point leaves one of the two in place or recoverable
    (:func:`recover`): rename the old folder aside, rename the new one into place, delete the old.
    """
    write_json_atomic(partial / MANIFEST, {"format": FORMAT_VERSION, **manifest}, make_parents=False)
    fsync_dir(partial)
    final = root / checkpoint_name(step)
    old = None
    if final.exists():
        old = root / f"{OLD_PREFIX}{final.name}-{new_token()}"
        os.rename(final, old)
    try:
        os.replace(partial, final)
    except BaseException:
        if old is not None and not final.exists():
            os.rename(old, final)
        raise
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def recover(root: Path) -> list[str]:
    """Rename back the checkpoints a crash left renamed aside mid-replacement (see
    :func:`finalize`) whose final name is free; return the names recovered."""
    recovered = []
    if not root.is_dir():
        return recovered
    for path in sorted(root.glob(f"{OLD_PREFIX}step-*")):
        name = path.name.removeprefix(OLD_PREFIX).rsplit("-", 1)[0]
        if _NAME.match(name) and not (root / name).exists():
            os.rename(path, root / name)
            recovered.append(name)
            log.warning("checkpoint %s: recovered from %s (a save replacing it was interrupted)", name, path.name)
    return recovered


def set_aside(root: Path, newer_than: int) -> list[str]:
    """Rename every checkpoint folder of a step after ``newer_than`` to ``.aside-<name>-<token>``.

    A resume from an older checkpoint passes over newer ones that do not verify; left in
    place, they would look newest to retention and to the next restart. They are kept (not
    deleted) for whoever wants to look at them. Returns the names set aside.
    """
    moved = []
    for step, path in list_checkpoints(root):
        if step > newer_than:
            target = root / f"{ASIDE_PREFIX}{path.name}-{new_token()}"
            os.rename(path, target)
            moved.append(path.name)
            log.warning("checkpoint %s is newer than the one resumed from and does not verify: moved to %s",
                        path.name, target.name)
    return moved


def check_directory(root: Path) -> None:
    """Make sure checkpoints can be written under ``root``: create it if missing, then check it is
    a directory this process can create files in (by creating one).

    Raises:
        ValueError: ``root`` (or a parent) is a file, or the directory is not writable.
    """
    if root.exists() and not root.is_dir():
        raise ValueError(f"checkpoint directory {str(root)!r} is not a directory: give a directory "
                         "(--checkpoint-dir) or remove the file")
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {str(root)!r} is not writable: {exc.strerror or exc}") from None


# Locks this process holds: resolved root -> open fd (flock is per open file, so a second
# open in the same process would conflict with the first).
_HELD: dict[Path, int] = {}


def lock(root: Path, wait_s: float = 5.0) -> None:
    """Hold ``root/.lock`` exclusively until this process ends (or :func:`unlock`).

    Waits up to ``wait_s`` seconds for it: after a restart, the previous attempt's rank 0 may
    take a moment to be gone. The holder's host and pid are written into the file, for the
    message another job gets. Opened without following a symlink.

    Raises:
        ValueError: another process holds it (naming that process), or it cannot be opened.
    """
    key = root.resolve()
    if key in _HELD:
        return
    try:
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {str(root)!r}: cannot open its lock: {exc.strerror or exc}") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise ValueError(
                    f"checkpoint directory {str(root)!r} is in use by another job ({holder}): give each job "
                    "its own --checkpoint-dir / --out"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}".encode(), 0)
    _HELD[key] = fd


def unlock(root: Path) -> None:
    """Release the lock :func:`lock` took (a no-op when not held)."""
    fd = _HELD.pop(root.resolve(), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories (final names), newest first: ``(step, path)``."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its shape checked (:func:`manifest_problem`).

    Raises:
        CorruptCheckpoint: it is missing, unreadable, or not shaped like a manifest.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{path.name}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    problem = manifest_problem(path.name, manifest)
    if problem:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is malformed: {problem}")
    return manifest


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def manifest_problem(name: str, manifest: dict[str, Any]) -> str:
    """What is wrong with the shape of checkpoint ``name``'s manifest ('' when nothing).

    Checked: ``step`` (the folder's), ``kind``, ``world_size``; ``files``: plain names inside
    the folder, each with ``bytes`` and ``sha256``; ``bases``: names ``step-NNNNNNNN`` including
    this one; ``tensors``: per group, entries whose ``in`` and deltas' ``in`` are among the
    bases; and the fit-check fields (``config``, ``config_hash``, ``params``).
    """
    match = _NAME.match(name)
    step = manifest.get("step")
    if not _is_int(step, 0) or (match is not None and int(match.group(1)) != step):
        return f"step {step!r} is not this folder's"
    if manifest.get("kind") not in ("full", "differential"):
        return f"kind {manifest.get('kind')!r} is not full or differential"
    if not _is_int(manifest.get("world_size"), 1):
        return f"world_size {manifest.get('world_size')!r} is not a positive integer"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "files is not a non-empty object"
    for file, entry in files.items():
        if not _FILE_NAME.match(file):
            return f"file name {file!r} is not a plain name inside the folder"
        if not isinstance(entry, dict) or not _is_int(entry.get("bytes"), 0) \
                or not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"]):
            return f"file {file!r} lacks bytes or sha256"
    bases = manifest.get("bases")
    if not isinstance(bases, list) or not all(isinstance(b, str) and _NAME.match(b) for b in bases):
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
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{path.name}/{name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CorruptCheckpoint(f"{path.name}/{name} has {size} bytes, the manifest says {entry['bytes']}")
        digest = hashlib.sha256()
        with open(file, "rb") as f:
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
    """Read a checkpoint file: tensors and plain containers only (``weights_only``)."""
    return torch.load(path, map_location="cpu", weights_only=True)


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
        if key not in files[holder]:
            raise CorruptCheckpoint(f"{holder}/{group}.pt lacks {key}")
        return files[holder][key]

    out: dict[str, torch.Tensor] = {}
    for key, entry in table.items():
        tensor = stored(entry["in"], key)
        if tensor_digest(tensor) != entry["sha256"]:
            raise CorruptCheckpoint(f"{entry['in']}/{group}.pt: {key} does not match its hash")
        for delta in entry.get("deltas", ()):
            payload = codecs.Encoded(tuple(stored(delta["in"], key)), tensor.shape, tensor.dtype)
            if delta["codec"] not in decoders:
                decoders[delta["codec"]] = codecs.make(delta["codec"])
            tensor = tensor + decoders[delta["codec"]].decode(payload)
        out[key] = tensor
    return out


def prune(root: Path, keep: int, token: str, written: str, verified: set[str] | None = None) -> list[str]:
    """Delete the checkpoints retention no longer needs, and other writers' partial folders
    (the caller holds the directory's :func:`lock`, so they are stale); return the names deleted.

    Kept: ``written`` (the checkpoint just saved) and its bases, and, newest first, the
    checkpoints that verify until ``keep`` of them are counted (``written`` among them), with
    their bases. A checkpoint that does not verify never counts, so retention can never leave
    only corrupt ones. ``verified``: names already known to verify (this writer's own saves),
    skipped by the check and extended with the ones checked here.
    """
    verified = verified if verified is not None else set()
    kept: set[str] = set()
    counted = 0
    for _, path in list_checkpoints(root):
        if counted >= keep and path.name != written:
            continue
        try:
            manifest = read_manifest(path) if path.name in verified else verify(root, path.name)
        except CorruptCheckpoint as exc:
            kept.add(written)  # never deleted, even if it does not verify
            log.warning("checkpoint %s does not verify (%s): not counted as one to keep", path.name, exc)
            continue
        verified.add(path.name)
        kept |= {path.name, *manifest["bases"]}
        counted += 1
    deleted = [p.name for _, p in list_checkpoints(root) if p.name not in kept]
    deleted += [p.name for p in root.iterdir() if p.name.startswith(PARTIAL_PREFIX) and not p.name.endswith(token)]
    for name in deleted:
        shutil.rmtree(root / name, ignore_errors=True)
        verified.discard(name)
    return deleted
