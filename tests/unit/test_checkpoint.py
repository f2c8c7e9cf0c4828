"""Checkpoint files: atomic layout, verification and fallback, differential = full, fit checks."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from poise import config as cfg
from poise.checkpoint import directory, layout
from poise.checkpoint.saver import Checkpointer, composed_grads, find_resume_point, load
from poise.checkpoint.state import TrainingState, fit_problems, rng_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _config(root: Path, **checkpoint) -> cfg.RunConfig:
    return cfg.from_dict({"out_dir": str(root), "task": {"name": "digits"},
                          "checkpoint": {"every_steps": 1, "async_save": False, **checkpoint}})


def _state(model: nn.Module, step: int) -> TrainingState:
    """A state of the structure a worker's has (what verification checks), with no optimizer."""
    tensors = {f"model/{k}": v for k, v in model.state_dict().items()}
    shared = {"step": step, "world_size": 1, "scheduler": {}, "optim_groups": [], "optim_scalars": {},
              "session": {}, "in_window": False, "note": [1, 2.5, "x"]}
    per_rank = {"step": step, "rng": rng_state(), "session": {"rank": 0, "window": None, "comm": None},
                "grads": None}
    return TrainingState(tensors, shared, per_rank)


def _train_last_layer(model: nn.Module, step: int) -> None:
    with torch.no_grad():
        model[4].weight.add_(0.01 * step)  # fine-tuning: only the head changes


def _save_run(root: Path, *, differential: bool, saves: int = 4, full_every: int = 10,
              async_save: bool = False) -> Checkpointer:
    model = _model()
    config = _config(root, differential=differential, full_every=full_every, async_save=async_save, keep=100)
    saver = Checkpointer(config, rank=0, world_size=1, store=None, attempt=0, model=model)
    for step in range(1, saves + 1):
        _train_last_layer(model, step)
        saver.save(_state(model, step))
    saver.wait()
    return saver


@pytest.mark.parametrize("async_save", [False, True])
def test_differential_restore_equals_full_restore_and_writes_only_what_changed(tmp_path, async_save):
    full = _save_run(tmp_path / "full", differential=False, async_save=async_save)
    diff = _save_run(tmp_path / "diff", differential=True, async_save=async_save)
    assert [r.kind for r in diff.records] == ["full", "differential", "differential", "differential"]
    assert [r.tensors_written for r in diff.records] == [6, 1, 1, 1]
    assert diff.records[-1].bytes_written < 0.1 * full.records[-1].bytes_written
    a_root, b_root = tmp_path / "full" / "checkpoints", tmp_path / "diff" / "checkpoints"
    name_a, manifest_a = layout.newest_good(a_root)
    name_b, manifest_b = layout.newest_good(b_root)
    assert name_a == name_b == "step-00000004"
    assert set(manifest_b["bases"]) == {"step-00000001", "step-00000004"}
    a, b = layout.load_tensors(a_root, manifest_a, "model"), layout.load_tensors(b_root, manifest_b, "model")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _train_all_layers(model: nn.Module, step: int) -> None:
    with torch.no_grad():  # full training: every tensor changes, by a different amount per entry
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))


@pytest.mark.parametrize("codec", ["int8", "topk"])
def test_lossy_deltas_restore_within_the_logged_error_and_the_error_does_not_grow(tmp_path, codec):
    model = _model()
    config = _config(tmp_path, differential=True, full_every=10, keep=100, delta_codec=codec)
    saver = Checkpointer(config, rank=0, world_size=1, store=None, attempt=0, model=model)
    truth = []
    for step in range(1, 7):
        _train_all_layers(model, step)
        saver.save(_state(model, step))
        truth.append({f"model/{k}": v.clone() for k, v in model.state_dict().items()})
    records = saver.records
    assert [r.kind for r in records] == ["full"] + ["differential"] * 5
    assert records[0].max_error == 0.0 and all(r.max_error > 0 for r in records[1:])
    if codec == "int8":  # a quarter of the bytes; the error stays one encoding's, not five
        assert all(r.bytes_written < 0.3 * records[0].bytes_written for r in records[1:])
        assert records[-1].max_error < 1.5 * records[1].max_error
    root = tmp_path / "checkpoints"
    for step, want in enumerate(truth, start=1):
        manifest = layout.verify(root, layout.checkpoint_name(step))
        got = layout.load_tensors(root, manifest, "model")
        error = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert error <= records[step - 1].max_error * (1 + 1e-6), step
    manifest = layout.verify(root, "step-00000006")
    assert set(manifest["bases"]) == {f"step-{s:08d}" for s in range(1, 7)}  # the base and every delta
    assert [d["in"] for d in manifest["tensors"]["model"]["model/0.weight"]["deltas"]] == [
        f"step-{s:08d}" for s in range(2, 7)]


def test_a_missing_delta_makes_the_checkpoint_fall_back(tmp_path):
    model = _model()
    config = _config(tmp_path, differential=True, keep=100, delta_codec="int8")
    saver = Checkpointer(config, rank=0, world_size=1, store=None, attempt=0, model=model)
    for step in range(1, 4):
        _train_all_layers(model, step)
        saver.save(_state(model, step))
    root = tmp_path / "checkpoints"
    shutil.rmtree(root / "step-00000002")  # a delta that steps 2 and 3 build on
    assert layout.newest_good(root)[0] == "step-00000001"


def test_a_full_base_every_k_saves_and_pruning_keeps_the_bases_in_use(tmp_path):
    model = _model()
    config = _config(tmp_path, differential=True, full_every=3, keep=2)
    saver = Checkpointer(config, rank=0, world_size=1, store=None, attempt=0, model=model)
    for step in range(1, 6):
        _train_last_layer(model, step)
        saver.save(_state(model, step))
    assert [r.kind for r in saver.records] == ["full", "differential", "differential", "full", "differential"]
    names = [p.name for _, p in layout.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step-00000005", "step-00000004"]  # step 5 builds on step 4, the newest base
    assert layout.newest_good(tmp_path / "checkpoints")[0] == "step-00000005"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "poise.checkpoint.layout" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "no-manifest", "base-missing"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage, caplog):
    _save_run(tmp_path, differential=True, saves=3)
    root = tmp_path / "checkpoints"
    newest = root / "step-00000003"
    target = newest / "model.pt"
    if damage == "bit-flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "no-manifest":
        (newest / layout.MANIFEST).unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poise.checkpoint.layout"):
        if damage == "base-missing":
            # every differential builds on step 1: without it nothing can be restored
            (root / "step-00000001" / "model.pt").unlink()
            assert layout.newest_good(root) is None
            assert len(_warnings(caplog)) == 3
            return
        name, _manifest = layout.newest_good(root)
    assert name == "step-00000002"
    (warning,) = _warnings(caplog)
    assert warning.getMessage().startswith("skipping checkpoint step-00000003: ")
    assert "\n" not in warning.getMessage()


def test_a_partial_directory_is_never_a_checkpoint(tmp_path):
    _save_run(tmp_path, differential=False, saves=1)
    root = tmp_path / "checkpoints"
    (root / layout.partial_name(2, layout.new_token())).mkdir()
    assert [p.name for _, p in layout.list_checkpoints(root)] == ["step-00000001"]


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/poise-checkpoint-ran-code"),))


def test_a_checkpoint_cannot_run_code_even_with_a_matching_checksum(tmp_path):
    _save_run(tmp_path, differential=False, saves=1)
    newest = tmp_path / "checkpoints" / "step-00000001"
    Path("/tmp/poise-checkpoint-ran-code").unlink(missing_ok=True)
    written = directory.write_payload(newest, "state.pt", {"evil": _Payload()})
    manifest = json.loads((newest / layout.MANIFEST).read_text())
    manifest["files"]["state.pt"] = written.entry()  # an attacker can fix the checksum up
    (newest / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))
    with pytest.raises(pickle.UnpicklingError):
        layout.load_file(newest / "state.pt")
    assert not Path("/tmp/poise-checkpoint-ran-code").exists()


def test_another_model_or_config_is_named_before_anything_is_loaded(tmp_path):
    _save_run(tmp_path, differential=False, saves=1)
    config = _config(tmp_path)
    name, manifest = find_resume_point(config, required=True)
    wider = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 4))
    problems = fit_problems(manifest, config, wider)
    assert problems == ["parameter 0.bias has shape [256] in the checkpoint but [512] now",
                        "parameter 0.weight has shape [256, 256] in the checkpoint but [512, 256] now",
                        "parameter 2.weight has shape [256, 256] in the checkpoint but [256, 512] now"]
    other = cfg.from_dict({**cfg.to_dict(config), "train": {"lr": 0.5}})
    with pytest.raises(ValueError, match=r"does not fit this run: train\.lr is None in the checkpoint but 0\.5 now "
                                         r"\[config hash \w{12} in the checkpoint, \w{12} now\]$"):
        load(other, name, manifest, rank=0, world_size=1, model=_model())
    assert load(config, name, manifest, rank=0, world_size=1, model=_model()).shared["step"] == 1


def test_resume_asked_for_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        find_resume_point(_config(tmp_path / "nowhere"), required=True)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ValueError, match="holds no complete, intact checkpoint"):
        find_resume_point(_config(tmp_path), required=True)


@pytest.mark.parametrize(("saved_world", "world"), [(3, 2), (2, 3), (4, 1)])
def test_accumulated_gradients_moved_to_another_world_size_reduce_to_the_same_average(tmp_path, saved_world, world):
    torch.manual_seed(1)
    grads = [{"w": torch.randn(5, 3), "b": torch.randn(3)} for _ in range(saved_world)]
    for r, g in enumerate(grads):
        directory.write_payload(tmp_path, layout.rank_file(r), {"grads": g})
    composed = [composed_grads(tmp_path, k, world, saved_world) or {} for k in range(world)]
    for key in ("w", "b"):
        want = sum(g[key] for g in grads) / saved_world  # DDP's average over the saved ranks
        got = sum(c[key] for c in composed if key in c) / world  # ... and over the new ranks
        torch.testing.assert_close(got, want)
