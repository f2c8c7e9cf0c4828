"""Checkpoints an attacker (or a bad disk) made: files that match their rehashed manifest but hold
no training state, symbolic links, a manifest nested 100,000 deep, unfinished saves after a full
disk, two jobs on one directory (issue 46, items 1, 4, 5, 9, 11)."""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poise.checkpoint import contents, directory, layout
from poise.checkpoint.saver import Checkpointer, find_resume_point
from poise.cli.checkpoint import run_list, run_verify
from tests.unit.test_checkpoint import _config, _model, _state
from tests.unit.test_checkpoint_safety import _HOLD, _names, _save


def _verify(root: Path) -> int:
    """``poise checkpoint verify ROOT`` (the command itself, without the CLI's logging setup)."""
    return run_verify(argparse.Namespace(dir=str(root)))


def _rehash(path: Path, name: str) -> None:
    """Make checkpoint ``path``'s manifest match its file ``name`` again, as an attacker would."""
    manifest = json.loads((path / layout.MANIFEST).read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))


def _rewrite(path: Path, name: str, payload: object) -> None:
    directory.write_payload(path, name, payload)
    _rehash(path, name)


def _reshaped_tensor(path: Path) -> None:
    """model.pt's head weight replaced by one of another shape, the tensor table rehashed too."""
    tensors = torch.load(path / "model.pt", weights_only=True)
    tensors["model/4.weight"] = torch.zeros(2, 3)
    manifest = json.loads((path / layout.MANIFEST).read_text())
    manifest["tensors"]["model"]["model/4.weight"]["sha256"] = layout.tensor_digest(tensors["model/4.weight"])
    (path / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))
    _rewrite(path, "model.pt", tensors)


def _retyped_tensor(path: Path) -> None:
    tensors = torch.load(path / "model.pt", weights_only=True)
    tensors["model/4.bias"] = tensors["model/4.bias"].to(torch.float64)
    manifest = json.loads((path / layout.MANIFEST).read_text())
    manifest["tensors"]["model"]["model/4.bias"]["sha256"] = layout.tensor_digest(tensors["model/4.bias"])
    (path / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))
    _rewrite(path, "model.pt", tensors)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/poise-attack-ran-code",))


_ATTACKS = {
    "reshaped-tensor": _reshaped_tensor,
    "retyped-tensor": _retyped_tensor,
    "pickle-payload": lambda p: _rewrite(p, "state.pt", {"evil": _Payload()}),
    "state-is-a-list": lambda p: _rewrite(p, "state.pt", [1, 2, 3]),
    "state-step-negative": lambda p: _rewrite(p, "state.pt", {**torch.load(p / "state.pt", weights_only=True),
                                                              "step": -7}),
    "rank-file-is-a-dict-of-junk": lambda p: _rewrite(p, layout.rank_file(0), {"step": 2}),
    "model-file-is-a-list": lambda p: _rewrite(p, "model.pt", [torch.zeros(1)]),
    "not-a-torch-file": lambda p: ((p / "optim.pt").write_bytes(b"\x00garbage" * 10), _rehash(p, "optim.pt")),
}


@pytest.mark.parametrize("attack", list(_ATTACKS), ids=list(_ATTACKS))
def test_a_rehashed_checkpoint_that_cannot_be_loaded_does_not_verify_and_is_passed_over(tmp_path, attack, capsys):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    directory.unlock(root)
    Path("/tmp/poise-attack-ran-code").unlink(missing_ok=True)
    _ATTACKS[attack](root / "step-00000002")
    layout.verify(root, "step-00000002")  # the checksums match: what passed before
    with pytest.raises(layout.CorruptCheckpoint, match="step-00000002"):
        contents.verify_loadable(root, "step-00000002")
    capsys.readouterr()  # what the saves logged (when an earlier test set up poise's logging)
    assert _verify(root) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not verify" in err and "Traceback" not in err
    name, _ = find_resume_point(_config(tmp_path, resume=True), required=True)
    assert name == "step-00000001"
    directory.unlock(root)
    assert not Path("/tmp/poise-attack-ran-code").exists()


def test_a_symlinked_file_or_step_folder_is_refused(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    directory.unlock(root)
    outside = tmp_path / "outside.pt"
    os.rename(root / "step-00000002" / "model.pt", outside)
    os.symlink(outside, root / "step-00000002" / "model.pt")  # same bytes: the checksum matches
    with pytest.raises(layout.CorruptCheckpoint, match="symbolic link"):
        layout.verify(root, "step-00000002")
    elsewhere = tmp_path / "elsewhere"
    os.rename(root / "step-00000001", elsewhere)
    os.symlink(elsewhere, root / "step-00000003", target_is_directory=True)
    with pytest.raises(layout.CorruptCheckpoint, match="symbolic link"):
        layout.read_manifest(root / "step-00000003")
    capsys.readouterr()  # what the saves logged (when an earlier test set up poise's logging)
    assert _verify(root) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert contents.newest_loadable(root) is None


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000],
                         ids=["arrays", "objects"])
def test_a_deeply_nested_manifest_is_refused_before_parsing(tmp_path, text, capsys):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    directory.unlock(root)
    (root / "step-00000002" / layout.MANIFEST).write_text(text)
    with pytest.raises(layout.CorruptCheckpoint, match=r"nests \d+ levels deep"):
        layout.read_manifest(root / "step-00000002")
    capsys.readouterr()  # what the saves logged (when an earlier test set up poise's logging)
    assert _verify(root) == 1
    assert run_list(argparse.Namespace(dir=str(root), json=True)) == 0
    out, err = capsys.readouterr()
    assert "RecursionError" not in out + err and "Traceback" not in err
    assert find_resume_point(_config(tmp_path, resume=True), required=True)[0] == "step-00000001"
    directory.unlock(root)


def test_an_oversized_manifest_is_refused_unread(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, [1])
    directory.unlock(root)
    monkeypatch.setattr(layout, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(layout.CorruptCheckpoint, match="larger than"):
        layout.read_manifest(root / "step-00000001")


def test_unfinished_saves_are_removed_and_never_the_last_good_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, [1])
    directory.unlock(root)
    stale = root / layout.partial_name(2, layout.new_token())
    stale.mkdir()
    (stale / "model.pt").write_bytes(b"x" * 1000)  # a save a full disk cut short
    model = _model()
    saver = Checkpointer(_config(tmp_path, keep=100), rank=0, world_size=1, store=None, attempt=0, model=model)
    assert not stale.exists()  # removed when the next job took the directory
    real = directory.write_payload

    def disk_full(path, name, payload):
        if name == "state.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, name, payload)

    monkeypatch.setattr(directory, "write_payload", disk_full)
    with pytest.raises(OSError, match="No space left"):
        saver.save(_state(model, 2))
    assert not [p for p in root.iterdir() if p.name.startswith(layout.PARTIAL_PREFIX)]
    assert _names(root) == ["step-00000001"] and contents.newest_loadable(root)[0] == "step-00000001"
    directory.unlock(root)


def test_a_second_resumer_changes_nothing_before_it_holds_the_lock(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    directory.unlock(root)
    (root / "step-00000002" / "model.pt").write_bytes(b"corrupt")  # would be set aside by a resume
    other = subprocess.Popen([sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another job .*pid {other.pid}"):
            find_resume_point(_config(tmp_path, resume=True), required=True)
        assert _names(root) == ["step-00000002", "step-00000001"]  # nothing renamed aside
    finally:
        other.kill()
        other.wait()
