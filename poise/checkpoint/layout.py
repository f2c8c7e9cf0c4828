"""The on-disk layout of checkpoints: files, manifests, verification, composing differentials.

One directory per checkpoint under the root, named by the step it was taken after::

    <root>/step-00000040/
        model.pt        rank 0: model tensors stored in this checkpoint (all, or the changed ones)
        optim.pt        rank 0: optimizer tensors, likewise
        state.pt        rank 0: everything else every rank shares (step, scheduler, data position...)
        rank-00001.pt   each rank: what differs per rank (RNG states, error-feedback residuals...)
        manifest.json   written last: size and sha256 of every file, where each tensor lives

While it is written the directory is ``.partial-step-00000040-a<attempt>``; it is renamed to
its final name after the manifest is on disk (fsync'd), so a checkpoint directory without
the ``.partial`` prefix is always complete. ``.pt`` files are read with
``torch.load(weights_only=True)``: only tensors and plain containers, never code.

A *differential* checkpoint stores only the tensors whose sha256 changed since the previous
checkpoint; its manifest's ``tensors`` table names, for every tensor, the checkpoint whose
files hold it (itself or an earlier one) and its hash. Loading composes them and checks each
tensor's hash, so a restore is bit-exact.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
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


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files are missing, truncated or do not match their checksums."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_name(step: int, attempt: int) -> str:
    return f".partial-{checkpoint_name(step)}-a{attempt}"


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
    write_atomic(directory / name, lambda h: h.write(data))
    return WrittenFile(name, len(data), hashlib.sha256(data).hexdigest())


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(root: Path, partial: Path, step: int, manifest: dict[str, Any]) -> Path:
    """Write the manifest into ``partial`` and rename it to the checkpoint's final name."""
    write_json_atomic(partial / MANIFEST, {"format": FORMAT_VERSION, **manifest})
    fsync_dir(partial)
    final = root / checkpoint_name(step)
    if final.exists():  # the same step saved by an earlier attempt: the newer one wins
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(root)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete-looking checkpoint directories (final names), newest first: ``(step, path)``."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``; CorruptCheckpoint when it is missing or unreadable."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is missing (incomplete checkpoint)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpoint(f"{path.name}: {MANIFEST} is unreadable ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{path.name}: format {manifest.get('format')!r}, expected {FORMAT_VERSION}")
    return manifest


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


def prune(root: Path, keep: int, attempt: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints and the bases they use, and partial
    directories of earlier attempts; return the names deleted."""
    complete = list_checkpoints(root)
    kept = {p.name for _, p in complete[:keep]}
    for name in list(kept):
        try:
            kept |= set(read_manifest(root / name)["bases"])
        except CorruptCheckpoint:
            pass
    deleted = [p.name for _, p in complete if p.name not in kept]
    stale = [p for p in root.iterdir() if p.name.startswith(".partial-") and not p.name.endswith(f"-a{attempt}")]
    deleted += [p.name for p in stale]
    for name in deleted:
        shutil.rmtree(root / name, ignore_errors=True)
    return deleted
