"""A Hugging Face user's script with poise, end to end: a random-init GPT-2 from ``transformers``
under Accelerate on 2 gloo processes (``examples/hf_accelerate.py``).

The mistakes such a user makes are refused before a step trains (the session's loader passed
through ``accelerator.prepare``, in both loop forms), counted loss terms give the exact
gradient of HF's shifted, padded loss, and a run with a rank under a CPU quota ends, every
time, with its outputs written."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.harness import run_cli

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "hf_accelerate.py"
TIMEOUT_S = 120


def _run(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return run_cli(["--nproc-per-node", "2", "--standalone", str(SCRIPT), "--out", str(out), *args], cwd=ROOT,
                   env=env, timeout_s=TIMEOUT_S, program="torchrun")


def test_hf_loss_gets_its_exact_gradient_without_a_count_and_mistakes_are_refused(tmp_path):
    """No num_items and no loss_terms, on the static split (where one term per sample was off by
    8.1e-3): the terms are counted from labels=, shifted as GPT-2's loss shifts them. The same run
    tries three mistakes, each refused in one line: clipping before the step's backward, a
    second attach on the prepared model, the former keyword rank_speed (issue 57, items 5, 7, 8)."""
    proc = _run(tmp_path, "--check-gradient", "--count-from-labels", "--balance", "static", "--check-misuse",
                "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(re.search(r"gradient max relative difference (\S+)", proc.stdout).group(1))
    assert worst < 1e-5, proc.stdout  # float32 sums in another order
    refused = [line.removeprefix("refused: ") for line in proc.stdout.splitlines() if line.startswith("refused: ")]
    assert refused[0].startswith("this DDP model already has a communication hook"), proc.stdout
    assert refused[1].startswith("session keyword(s) rank_speed (now emulate='RANK:SPEED,...'"), proc.stdout
    assert refused[2].startswith("accelerator.clip_grad_norm_() in step 0 before step.backward(loss): there is no "
                                 "gradient yet"), proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 2 and report["world_size"] == 2 and report["balance_strategy"] == "static"


@pytest.mark.parametrize("loop", ["steps", "step-context"])
def test_the_sessions_loader_through_accelerate_prepare_is_refused(tmp_path, loop):
    proc = _run(tmp_path, "--prepare-loader", "--steps", "2", *(["--step-context"] if loop == "step-context" else []))
    assert proc.returncode != 0
    expected = ("it batches with a BatchSamplerShard around it (accelerator.prepare(loader)?)" if loop == "steps"
                else "the session's DataLoader went through accelerator.prepare")
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "report.json").exists()  # nothing trained


def test_a_rank_under_a_cpu_quota_ends_cleanly(tmp_path):
    """The case that used to hang at exit (rank 1 slowed, dynamic's re-plans): it ends, with its report."""
    proc = _run(tmp_path, "--emulate", "1:0.5", "--steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == 6


@pytest.mark.long(covered_by="tests/e2e/test_huggingface.py::test_a_rank_under_a_cpu_quota_ends_cleanly")
def test_a_rank_under_a_cpu_quota_ends_cleanly_every_time(tmp_path):
    """Bounded repeats of the case that used to hang at exit; each must end, with its report."""
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        proc = _run(out, "--emulate", "1:0.5", "--steps", "6")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((out / "report.json").read_text())["steps"] == 6
