"""One-line refusals of bad input before anything runs (issue 16, items 4, 5, 6, 10, 11)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from poise import config as cfg
from poise.checkpoint import directory
from poise.checkpoint.saver import Checkpointer
from poise.cli import build_parser, main
from poise.cli import train as train_cli
from poise.train.recipe import clip_and_step
from tests.unit.test_checkpoint import _config, _model, _state


def _record(*flags: str):
    return train_cli.record_config(build_parser().parse_args(["train", "--task", "digits", *flags]))


@pytest.mark.parametrize("key,value", [
    ("dist.timeout_s", "inf"), ("train.lr", "inf"), ("train.grad_clip_norm", "nan"), ("train.weight_decay", "nan"),
    ("comm.bucket_mb", "inf"), ("pipeline.memory_cap_bytes", "inf"), ("balance.cost_alpha", "nan"),
])
def test_non_finite_settings_are_refused(key, value):
    section, name = key.split(".")
    with pytest.raises(ValueError, match=rf"^{key}=(inf|nan) is invalid: it must be a finite number$"):
        cfg.from_dict({section: {name: value}})


@pytest.mark.parametrize("settings,match", [
    ({"dist": {"nproc": 2}, "balance": {"rank_speed": "7:0.5"}}, r"balance.rank_speed names rank 7, .* 0..1$"),
    ({"dist": {"nproc": 2}, "faults": {"fail_at": "2:3"}}, r"faults.fail_at='2:3' names rank 2, .* 0..1$"),
    ({"dist": {"nproc": 64}, "cluster": {"nodes": 64}}, r"4096 processes on this machine: allowed is at most 64"),
])
def test_ranks_beyond_the_world_and_huge_clusters_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        cfg.from_dict(settings)


def test_ranks_inside_an_elastic_or_cluster_world_are_accepted():
    cfg.from_dict({"dist": {"nproc": 2, "nnodes": "1:2", "rdzv_endpoint": "h:1"}, "balance": {"rank_speed": "3:0.5"}})
    cfg.from_dict({"dist": {"nproc": 2}, "cluster": {"nodes": 2}, "faults": {"fail_at": "3:4"}})


def test_the_cli_turns_them_into_exit_2(capsys):
    assert main(["train", "--task", "digits", "--dist.timeout_s", "inf"]) == 2
    assert main(["train", "--task", "digits", "--nproc", "2", "--rank-speed", "7:0.5"]) == 2
    assert main(["train", "--cluster", "64:64"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("poise train: error: ") for line in lines)


def test_an_earlier_run_is_not_overwritten(tmp_path):
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already holds a run .*report.json.*--overwrite"):
        _record("--out", str(tmp_path))
    config, _ = _record("--out", str(tmp_path), "--overwrite")
    assert config.out_dir == str(tmp_path.resolve())


def test_what_a_sibling_node_or_a_bench_left_is_not_a_run(tmp_path):
    (tmp_path / "config.toml").write_text("")
    (tmp_path / "train.log").write_text("")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".lock").write_text("")
    (tmp_path / ".config.toml.pp0lp19z.tmp").write_text("")  # a sibling node writing config.toml now
    config, _ = _record("--out", str(tmp_path))
    assert config.out_dir == str(tmp_path.resolve())


def test_default_output_directories_do_not_collide_within_a_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_cli.time, "strftime", lambda fmt: "20250101-000000")
    a, b = train_cli.default_out_dir(), train_cli.default_out_dir()
    assert a != b and Path(a).is_dir() and Path(b).is_dir()


def test_a_checkpoint_directory_that_is_a_file_fails_before_launch(tmp_path):
    file = tmp_path / "ckpt"
    file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        _record("--out", str(tmp_path / "out"), "--checkpoint-every", "5", "--checkpoint-dir", str(file))


def _saved(root: Path, steps: int) -> None:
    model = _model()
    saver = Checkpointer(_config(root.parent, differential=True, keep=100), rank=0, world_size=1, store=None,
                         attempt=0, model=model)
    for step in range(1, steps + 1):
        with torch.no_grad():
            model[4].weight.add_(0.01)
        saver.save(_state(model, step))
    saver.wait()
    directory.unlock(root)


def test_checkpoint_list_and_verify(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _saved(root, 3)
    assert main(["checkpoint", "list", str(root), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["kind"], r["base"], r["verified"]) for r in rows] == [
        (3, "differential", "step-00000001", True), (2, "differential", "step-00000001", True),
        (1, "full", None, True)]
    assert all(r["bytes"] > 0 for r in rows)
    assert main(["checkpoint", "verify", str(root)]) == 0
    data = bytearray((root / "step-00000003" / "model.pt").read_bytes())
    data[-5] ^= 1
    (root / "step-00000003" / "model.pt").write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(root)]) == 1
    assert "step-00000003 does not verify" in capsys.readouterr().err
    assert main(["checkpoint", "list", str(root), "--json"]) == 0
    assert [json.loads(line)["verified"] for line in capsys.readouterr().out.splitlines()] == [False, True, True]
    assert main(["checkpoint", "verify", str(tmp_path / "missing")]) == 2


def test_non_finite_gradients_stop_training_with_on_nonfinite_error():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with pytest.raises(FloatingPointError, match="gradient norm is nan at step 7 on rank 1"):
        clip_and_step(model, optimizer, scheduler, 1.0, 7, "error", 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.inf)
    assert clip_and_step(model, optimizer, scheduler, 1.0, 8, "skip", 1) is True


def test_a_value_with_a_line_break_is_still_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--bogus", "a\nb"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a\\nb" in err
