"""Changing a checkpoint root on disk: writing a checkpoint and renaming it into place, the
root's lock, recovering an interrupted replacement, setting aside and pruning old checkpoints.

The names and the manifest these follow are :mod:`poise.checkpoint.layout`'s. Each change is
made so that a crash at any point leaves every checkpoint either complete under its final
name or out of the way under a dot-prefixed one: files are written to temporary names,
fsync'd and renamed; a folder is renamed into place only after its manifest is on disk; a
replaced checkpoint is renamed aside before the new one takes its name (:func:`finalize`,
undone by :func:`recover`). Only the job holding the root's :func:`lock` changes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poise.checkpoint.layout import (
    ASIDE_PREFIX,
    FORMAT_VERSION,
    LOCK,
    MANIFEST,
    NAME_PATTERN,
    OLD_PREFIX,
    PARTIAL_PREFIX,
    CorruptCheckpoint,
    checkpoint_name,
    list_checkpoints,
    new_token,
    read_manifest,
    sealed,
    verify,
)
from poise.files import write_atomic, write_json_atomic

log = logging.getLogger(__name__)


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
    write_json_atomic(partial / MANIFEST, sealed({"format": FORMAT_VERSION, **manifest}), make_parents=False)
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
        if NAME_PATTERN.match(name) and not (root / name).exists():
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
    check_writable(root, "checkpoint directory", "--checkpoint-dir")


def check_writable(root: Path, what: str, flag: str) -> None:
    """Create directory ``root`` if missing and check that this process can create files in it
    (by creating one); ``what`` and ``flag`` name it in the message.

    Raises:
        ValueError: ``root`` or a parent is a file, or it cannot be created or written (a
            read-only file system, no permission), in one line.
    """
    for parent in [root, *root.parents]:
        if parent.exists() and not parent.is_dir():
            where = "" if parent == root else f" (under {str(parent)!r}, a file)"
            raise ValueError(f"{what} {str(root)!r} is not a directory{where}: give a directory ({flag}) "
                             "or remove the file")
        if parent.exists():
            break
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=root, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{what} {str(root)!r} is not writable: {exc.strerror or exc} ({flag})") from None


# Locks this process holds: (resolved directory, lock file name) -> open fd (flock is per open
# file, so a second open in the same process would conflict with the first).
_HELD: dict[tuple[Path, str], int] = {}


def lock(root: Path, wait_s: float = 5.0, *, name: str = LOCK, what: str = "checkpoint directory",
         flag: str = "--checkpoint-dir / --out", shared: bool = False) -> None:
    """Hold ``root/name`` exclusively (or ``shared`` with other shared holders, excluding
    exclusive ones) until this process ends (or :func:`unlock`).

    Waits up to ``wait_s`` seconds for it: after a restart, the previous attempt's rank 0 may
    take a moment to be gone. The holder's host and pid are written into the file, for the
    message another job gets. Opened without following a symlink. ``what`` and ``flag`` name
    the directory in that message (``poise train`` locks its ``--out`` too).

    Raises:
        ValueError: another process holds it (naming that process), or it cannot be opened.
    """
    key = (root.resolve(), name)
    if key in _HELD:
        return
    try:
        fd = os.open(root / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ValueError(f"{what} {str(root)!r}: cannot open its lock: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device put there: never waited on or read
        os.close(fd)
        raise ValueError(f"{what} {str(root)!r}: its lock {name} is not a regular file: remove it, or give "
                         f"another {flag}")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = printable(os.pread(fd, 200, 0).decode(errors="replace")) or "unknown"
                os.close(fd)
                raise ValueError(
                    f"{what} {str(root)!r} is in use by another job ({holder}): give each job its own {flag}"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}".encode(), 0)
    _HELD[key] = fd


def printable(text: str) -> str:
    """``text`` with every character but printable ASCII replaced by ``?``, stripped: what another
    process wrote (a lock's holder) may hold terminal escape codes, which must not reach the
    user's terminal in our message."""
    return "".join(c if " " <= c <= "~" else "?" for c in text).strip()


def unlock(root: Path, name: str = LOCK) -> None:
    """Release the lock :func:`lock` took (a no-op when not held)."""
    fd = _HELD.pop((root.resolve(), name), None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def clean_partials(root: Path, keep_token: str | None = None) -> list[str]:
    """Delete the partial folders of saves that never finished (a full disk, a crash), but for
    ``keep_token``'s; the caller holds the root's :func:`lock`, so no other writer is using them.
    A partial folder is never a checkpoint (:mod:`poise.checkpoint.layout`), so nothing good is
    lost, and a resume on a full disk gets its room back. Returns the names deleted."""
    if not root.is_dir():
        return []
    deleted = [p.name for p in root.iterdir() if p.name.startswith(PARTIAL_PREFIX)
               and (keep_token is None or not p.name.endswith(keep_token))]
    for name in deleted:
        _remove(root / name)
    if deleted:
        log.info("removed %d unfinished save(s) in %s: %s", len(deleted), root, ", ".join(deleted[:3]))
    return deleted


def remove_partial(path: Path) -> None:
    """Delete one save's partial folder (a name with :data:`PARTIAL_PREFIX`, never a checkpoint),
    or the link by that name."""
    if path.name.startswith(PARTIAL_PREFIX):
        _remove(path)


def _remove(path: Path) -> None:
    """Delete a folder, or the symbolic link itself (never what it points to)."""
    if path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


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
    for name in deleted:
        _remove(root / name)
        verified.discard(name)
    return deleted + clean_partials(root, keep_token=token)
