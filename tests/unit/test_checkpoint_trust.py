"""What a checkpoint takes on trust from others, and no longer does (issue 57, items 11, 13, 16):
a rank's note in the job's store (any local process can write there), outer-step state that
verifies but cannot be resumed, a manifest's world size."""

from __future__ import annotations

import argparse
import errno
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from poise.checkpoint import contents, directory, layout
from poise.checkpoint.saver import _TOKEN_KEY, Checkpointer
from poise.cli.checkpoint import run_verify
from poise.cli.train import remove_unfinished_saves
from poise.runtime.launcher import JOB_KEY_ENV
from tests.bounded import run_bounded
from tests.unit.test_checkpoint import _config, _model, _state
from tests.unit.test_checkpoint_attacks import _rewrite
from tests.unit.test_checkpoint_safety import _save


def _two_ranks(root: Path) -> tuple[Checkpointer, Checkpointer, dist.Store]:
    store = dist.HashStore()
    model = _model()
    config = _config(root.parent, differential=False)
    savers = [Checkpointer(config, rank=r, world_size=2, store=store, attempt=0, model=model) for r in (0, 1)]
    return savers[0], savers[1], store


def _save_both(rank0: Checkpointer, rank1: Checkpointer, step: int) -> None:
    state = _state(_model(), step)
    state.shared["world_size"] = 2
    rank1.save(state)  # sync saves: rank 1's note is in the store before rank 0 waits for it
    rank0.save(state)


def test_a_rank_that_wrote_elsewhere_makes_the_save_fail_instead_of_a_checkpoint_missing_it(tmp_path, monkeypatch):
    monkeypatch.delenv(JOB_KEY_ENV, raising=False)  # a plain torchrun job: the token goes through the store
    root = tmp_path / "checkpoints"
    rank0, rank1, store = _two_ranks(root)
    store.set(_TOKEN_KEY, "0123456789abcdef")  # another local process replaced it
    with pytest.raises(RuntimeError, match=r"checkpoint step-00000001: a rank's part is not on disk as its note"):
        _save_both(rank0, rank1, 1)
    assert layout.list_checkpoints(root) == []  # nothing counted as saved
    assert not [p for p in root.iterdir() if p.name.startswith(layout.PARTIAL_PREFIX + "step-00000001-"
                                                                + rank0.token())]


def test_under_a_poise_launcher_the_writer_token_is_not_read_from_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv(JOB_KEY_ENV, "5ec7e7" * 4)
    root = tmp_path / "checkpoints"
    rank0, rank1, store = _two_ranks(root)
    store.set(_TOKEN_KEY, "0123456789abcdef")  # replaced: read by no rank
    _save_both(rank0, rank1, 1)
    assert rank1.token() == rank0.token() != "0123456789abcdef"
    contents.verify_loadable(root, "step-00000001")


@pytest.mark.parametrize("which", ["torch", "numpy"])
def test_a_rank_state_with_an_rng_of_the_wrong_length_does_not_verify(tmp_path, which):
    """Issue 57, item 12: it verified, restored on the other ranks and failed on this one."""
    root = tmp_path / "checkpoints"
    _save(root, [1])
    path = root / "step-00000001"
    state = torch.load(path / layout.rank_file(0), weights_only=True)
    if which == "torch":
        state["rng"]["torch"] = state["rng"]["torch"][:-8]
    else:
        state["rng"]["numpy"][1] = state["rng"]["numpy"][1][:100]
    _rewrite(path, layout.rank_file(0), state)
    with pytest.raises(layout.CorruptCheckpoint, match=f"rank-00000.pt is not a rank's training state: rng.{which}"):
        contents.verify_loadable(root, path.name)


def _outer(**change: object) -> dict:
    """A rank's saved outer-step (DiLoCo) state of the shape poise.sync.OuterSync saves."""
    comm = {"inner": {"step": 0, "codec": {}}, "steps": 8, "outer_steps": 2, "inner_steps": 4, "per_step": False,
            "choice": None, "warmup_left": 0, "local": [torch.zeros(3)], "global": [torch.zeros(3)],
            "momenta": [torch.zeros(3)], "tokens": [10.0], "in_sync": [False], "codec": {},
            "pending": [{"fragment": 0, "apply_after": 9, "result": None}]}
    return {**comm, **change}


@pytest.mark.parametrize(("rank1", "rank0", "message"), [
    (_outer(momenta=[torch.tensor([0.0, float("nan"), 0.0])]), None,
     "rank-00001.pt is not a rank's training state: session.comm.momenta holds a value that is not finite"),
    (_outer(inner_steps=0), _outer(inner_steps=0),
     "rank-00000.pt is not a rank's training state: session.comm.inner_steps is 0: not a count from 1"),
    (_outer(pending=[{"fragment": 99, "apply_after": 9, "result": None}]), None,
     "rank-00001.pt is not a rank's training state: session.comm.pending names fragment 99: the state has 1"),
    (_outer(steps=-1000), _outer(steps=-1000),
     "rank-00000.pt is not a rank's training state: session.comm.steps is -1000: not a count from 0"),
    (_outer(inner_steps=7), None,
     "the ranks' states disagree: session.comm.inner_steps is 7 on rank 1 but 4 on rank 0"),
], ids=["nan-momentum", "zero-inner-steps", "fragment-99", "negative-steps", "one-rank-inner-steps"])
def test_outer_step_state_a_resume_cannot_use_does_not_verify(tmp_path, monkeypatch, rank1, rank0, message):
    """Issue 57, item 13: each verified, then failed at the first step, hung, or trained the
    ranks apart (exit 0 with different weights)."""
    monkeypatch.setenv(JOB_KEY_ENV, "5ec7e7" * 4)
    root = tmp_path / "checkpoints"
    savers = _two_ranks(root)[:2]
    for rank in (1, 0):
        state = _state(_model(), 1)
        state.shared["world_size"] = 2
        state.per_rank["session"] = {"rank": rank, "window": None, "comm": (rank0 or _outer()) if rank == 0 else rank1}
        savers[rank].save(state)
    with pytest.raises(layout.CorruptCheckpoint) as err:
        contents.verify_loadable(root, "step-00000001")
    assert str(err.value).startswith("step-00000001") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("world", [10**12, 2**70, 5], ids=["1e12", "2^70", "more-than-files"])
def test_a_world_size_past_the_files_listed_is_refused_at_once(tmp_path, world):
    """Issue 57, item 16: 10^12 ran 71 s to a MemoryError at 3.4 GB, 2^70 hung (verify and --resume)."""
    root = tmp_path / "checkpoints"
    _save(root, [1])
    manifest = json.loads((root / "step-00000001" / layout.MANIFEST).read_text())
    manifest["world_size"] = world
    (root / "step-00000001" / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))
    outcome = run_bounded(run_verify, argparse.Namespace(dir=str(root)), memory_bytes=256 << 20, timeout_s=20)
    assert outcome.kind == "ok" and outcome.value == 1, outcome.describe()
    assert "world_size" in outcome.err and outcome.err.count("\n") == 1, outcome.err


def test_a_rank_whose_part_does_not_fit_on_the_disk_removes_the_saves_folder(tmp_path, monkeypatch):
    """Issue 57, item 18: after a rank's save failed on a full disk, the launcher stopped rank 0
    in its wait for that rank, and the save's partial folder stayed, holding the disk."""
    monkeypatch.setenv(JOB_KEY_ENV, "5ec7e7" * 4)
    root = tmp_path / "checkpoints"
    _, rank1, _ = _two_ranks(root)
    real = directory.write_payload

    def full_disk(folder: Path, name: str, payload: object) -> directory.WrittenFile:
        real(folder, name, payload)  # a part of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directory, "write_payload", full_disk)
    state = _state(_model(), 1)
    state.shared["world_size"] = 2
    with pytest.raises(OSError, match="No space left"):
        rank1.save(state)
    assert [p.name for p in root.iterdir() if p.name.startswith(layout.PARTIAL_PREFIX)] == []


def test_the_command_removes_unfinished_saves_once_its_workers_are_gone(tmp_path):
    config = _config(tmp_path)
    root = Path(config.checkpoint_dir)
    (root / f"{layout.PARTIAL_PREFIX}step-00000002-0123456789abcdef").mkdir(parents=True)
    (root / f"{layout.PARTIAL_PREFIX}step-00000002-0123456789abcdef" / "rank-00000.pt").write_bytes(b"x" * 100)
    remove_unfinished_saves(config)
    assert not [p for p in root.iterdir() if p.name.startswith(layout.PARTIAL_PREFIX)]


def test_a_manifest_changed_after_it_was_written_does_not_verify_and_one_without_a_checksum_still_does(tmp_path):
    """Issue 57, item 16: the manifest was covered by no checksum; a changed setting in it read
    as another run's config (the job stopped) instead of a damaged checkpoint (fall back)."""
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    path = root / "step-00000002" / layout.MANIFEST
    manifest = json.loads(path.read_text())
    assert manifest[layout.SEAL] == layout.seal_of(manifest)
    key = next(iter(manifest["config"]))
    path.write_text(json.dumps({**manifest, "config": {**manifest["config"], key: "flipped"}}))
    with pytest.raises(layout.CorruptCheckpoint, match=r"manifest\.json does not match its own checksum"):
        layout.read_manifest(path.parent)
    assert layout.newest_good(root)[0] == "step-00000001"
    path.write_text(json.dumps({k: v for k, v in manifest.items() if k != layout.SEAL}))  # an older poise's
    contents.verify_loadable(root, "step-00000002")
