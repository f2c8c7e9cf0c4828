"""``poise train --parallel fsdp|hsdp`` through the real launcher: a sharded job killed mid-run
resumes from its checkpoint of full tensors and ends as the uninterrupted one ends; HSDP on 4
ranks (2 shard groups of 2) trains and saves; dp-pp is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from poise.checkpoint import layout
from poise.tasks.digits import DigitsCNN
from tests.conftest import run_poise

pytestmark = pytest.mark.e2e

# digits: 1437 training samples, 2 x 32 per step: 22 steps per epoch, 44 in 2 epochs;
# checkpoints every 9 steps, rank 1 killed before step 30: the restart resumes from step 27
JOB = ("train", "--task", "digits", "--nproc", "2", "--epochs", "2", "--batch-size", "32", "--parallel", "fsdp",
       "--checkpoint-every", "9", "--dist.timeout_s", "30", "--diagnostics.progress", "false",
       "--diagnostics.plot", "false")


def final_model(out: Path, step: int) -> dict[str, torch.Tensor]:
    root = out / "checkpoints"
    _name, manifest = layout.newest_good(root)
    assert manifest["step"] == step
    return {k.removeprefix("model/"): v for k, v in layout.load_tensors(root, manifest, "model").items()}


@pytest.mark.timeout(400)
def test_killed_fsdp_job_resumes_and_ends_as_if_uninterrupted(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = run_poise(*JOB, "--out", str(whole), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_poise(*JOB, "--fail-at", "1:30", "--max-restarts", "1", "--out", str(killed), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "injected fault: rank 1 kills itself before step 30" in proc.stderr
    report = json.loads((killed / "report.json").read_text())
    assert report["restarts"] == 1
    assert report["resumed_from"] == "step-00000027" and report["first_step"] == 27

    a, b = final_model(whole, 44), final_model(killed, 44)
    assert sorted(a) == sorted(name for name, _ in DigitsCNN().named_parameters())  # full, unsharded names
    for key in a:
        assert a[key].shape == dict(DigitsCNN().named_parameters())[key].shape, key
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=key)
    want = json.loads((whole / "report.json").read_text())
    assert report["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
    assert report["config"]["parallel"]["mode"] == "fsdp"


@pytest.mark.timeout(400)
def test_fsdp_checkpoint_resumes_on_three_ranks(tmp_path):
    """Full tensors restore on any number of ranks: a 2-rank job stopped after step 27's
    checkpoint finishes on 3 ranks (the rest of the epoch re-planned over them)."""
    first = run_poise(*JOB, "--fail-at", "1:30", "--out", str(tmp_path), timeout_s=180)
    assert first.returncode == 1  # no restarts: the job stops, checkpoint 27 is on disk
    job = [a if a != "2" or i != JOB.index("--nproc") + 1 else "3" for i, a in enumerate(JOB)]
    proc = run_poise(*job, "--resume", "--out", str(tmp_path), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming on 3 ranks from a checkpoint of 2" in proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resumed_from"] == "step-00000027" and len(report["per_rank"]) == 3
    assert report["first_step"] == 27 and report["eval_accuracy"] > 0.8


@pytest.mark.timeout(400)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_hsdp_on_four_ranks_trains_and_saves_full_tensors(tmp_path, codec):
    """2 shard groups of 2 ranks: FSDP2's own HSDP (none), or the shard dimension only with
    poise's int8 on the all-reduce between the groups (from step 1 on)."""
    proc = run_poise("train", "--task", "digits", "--nproc", "4", "--steps", "4", "--batch-size", "16",
                     "--parallel", "hsdp", "--parallel.shard_size", "2", "--codec", codec, "--comm.start_step", "1",
                     "--checkpoint-every", "2", "--task.eval_max_samples", "64", "--dist.timeout_s", "60",
                     "--diagnostics.progress", "false", "--diagnostics.plot", "false", "--out", str(tmp_path),
                     timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["eval_count"] == 64 and report["steps"] == 4
    assert report["sync"]["codec_on"] == ("replicate all-reduce" if codec == "int8" else "reduce-scatter")
    saved = final_model(tmp_path, 4)
    for name, param in DigitsCNN().named_parameters():
        assert saved[name].shape == param.shape, name


def test_dp_pp_is_refused_by_poise_train_in_one_line(tmp_path):
    proc = run_poise("train", "--task", "digits", "--parallel", "dp-pp", "--out", str(tmp_path / "out"),
                     timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "parallel.mode='dp-pp' is data x pipeline parallelism: run it with `poise pipeline` "
        "(poise train takes ddp, fsdp or hsdp)")
    assert not (tmp_path / "out").exists()  # refused before anything was written
