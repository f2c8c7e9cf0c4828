"""Checkpoints that cannot be lost: retention that keeps what verifies, manifests checked for
shape, one job per directory, a directory checked before training (issue 16, items 1-3, 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poise.checkpoint import directory, layout
from poise.checkpoint.saver import Checkpointer, find_resume_point
from tests.unit.test_checkpoint import _config, _model, _state, _train_last_layer


def _save(root: Path, steps: list[int], keep: int = 100) -> Checkpointer:
    model = _model()
    saver = Checkpointer(_config(root.parent, keep=keep, differential=False), rank=0, world_size=1, store=None,
                         attempt=0, model=model)
    for step in steps:
        _train_last_layer(model, step)
        saver.save(_state(model, step))
    saver.wait()
    return saver


def _corrupt(path: Path) -> None:
    data = bytearray((path / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x10
    (path / "model.pt").write_bytes(bytes(data))


def _names(root: Path) -> list[str]:
    return [p.name for _, p in layout.list_checkpoints(root)]


def test_retention_never_leaves_only_corrupt_checkpoints(tmp_path):
    """The reproduction: 10 good, 30 corrupt, then a save at 20 with keep=1."""
    root = tmp_path / "checkpoints"
    _save(root, [10, 30])
    directory.unlock(root)
    _corrupt(root / "step-00000030")
    _save(root, [20], keep=1)
    found = layout.newest_good(root)
    assert found is not None and found[0] == "step-00000020"
    assert "step-00000020" in _names(root)


def test_resume_sets_newer_checkpoints_aside_and_retention_keeps_the_good_one(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [10, 30])
    directory.unlock(root)
    _corrupt(root / "step-00000030")
    name, _ = find_resume_point(_config(tmp_path, resume=True), required=True)
    assert name == "step-00000010"
    assert _names(root) == ["step-00000010"]
    aside = [p.name for p in root.iterdir() if p.name.startswith(".aside-step-00000030-")]
    assert len(aside) == 1  # kept, not deleted
    _save(root, [20], keep=1)
    assert _names(root) == ["step-00000020"]
    assert layout.newest_good(root)[0] == "step-00000020"


def test_a_crash_while_replacing_a_checkpoint_loses_neither(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    _save(root, [5])
    before = (root / "step-00000005" / "model.pt").read_bytes()
    real_replace = os.replace

    def crash(src, dst):
        if Path(dst).name == "step-00000005":
            raise OSError("crash between the two renames")
        return real_replace(src, dst)

    monkeypatch.setattr(directory.os, "replace", crash)
    with pytest.raises(OSError, match="crash between"):
        _save(root, [5])
    monkeypatch.undo()
    directory.recover(root)
    assert layout.newest_good(root)[0] == "step-00000005"
    assert (root / "step-00000005" / "model.pt").read_bytes() == before


def test_recover_renames_back_a_checkpoint_left_aside_by_a_hard_crash(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [5])
    os.rename(root / "step-00000005", root / ".old-step-00000005-0123456789abcdef")
    assert directory.recover(root) == ["step-00000005"]
    assert layout.newest_good(root)[0] == "step-00000005"


@pytest.mark.parametrize("damage", [
    lambda m: [],
    lambda m: {k: v for k, v in m.items() if k != "files"},
    lambda m: {**m, "files": {k: {"sha256": v["sha256"]} for k, v in m["files"].items()}},
    lambda m: {**m, "files": {"../outside.pt": next(iter(m["files"].values()))}},
    lambda m: {**m, "bases": ["../../etc"]},
    lambda m: {**m, "tensors": {"model": {"w": {"in": "../x", "sha256": "0" * 64}}, "optim": {}}},
    lambda m: {**m, "step": "7"},
], ids=["list", "no-files", "no-bytes", "path-in-name", "bad-base", "holder-outside-bases", "step-type"])
def test_a_malformed_manifest_falls_back_to_the_previous_checkpoint(tmp_path, damage):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    path = root / "step-00000002" / layout.MANIFEST
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    with pytest.raises(layout.CorruptCheckpoint, match="step-00000002"):
        layout.read_manifest(root / "step-00000002")
    assert layout.newest_good(root)[0] == "step-00000001"


_HOLD = """
import sys, time
from pathlib import Path
from poise.checkpoint import directory
directory.lock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_two_jobs_cannot_share_a_checkpoint_directory(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    other = subprocess.Popen([sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=f"in use by another job .*pid {other.pid}"):
            Checkpointer(_config(tmp_path), rank=0, world_size=1, store=None, attempt=0, model=_model())
    finally:
        other.kill()
        other.wait()


def test_partial_folders_are_unique_per_writer_and_a_removed_directory_is_not_recreated(tmp_path):
    assert layout.partial_name(4, layout.new_token()) != layout.partial_name(4, layout.new_token())
    root = tmp_path / "checkpoints"
    model = _model()
    saver = Checkpointer(_config(tmp_path), rank=0, world_size=1, store=None, attempt=0, model=model)
    for path in root.iterdir():
        path.unlink()
    root.rmdir()
    with pytest.raises(FileNotFoundError, match="is gone"):
        saver.save(_state(model, 1))
    assert not root.exists()


def test_a_checkpoint_directory_that_is_a_file_is_refused_before_training(tmp_path):
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        directory.check_directory(file)
    with pytest.raises(ValueError, match="is not a directory"):
        Checkpointer(_config(tmp_path, dir=str(file)), rank=0, world_size=1, store=None, attempt=0, model=_model())


def test_lock_is_released_with_its_process(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    other = subprocess.Popen([sys.executable, "-c", _HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "held"
    other.kill()
    other.wait()
    directory.lock(root, wait_s=0.0)  # no waiting at all: it raises if the dead process still held it
    directory.unlock(root)
