"""The Lightning and Accelerate adapters end to end: each on 2 gloo processes under torch's
launcher, with the real framework, a cost-balanced sampler (ranks' batches differ) and the
fp16 codec; the first optimizer step's gradient is recomputed here in one process."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.e2e.scripts import toy
from tests.harness import run_cli

pytestmark = pytest.mark.e2e

SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
TIMEOUT_S = 120


def _launch(script: str, out: Path, *args: str) -> dict:
    """Run ``script`` on 2 ranks (bounded); its report.json, after checking the other outputs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = run_cli(["--nproc-per-node", "2", "--standalone", str(SCRIPTS / script), "--out", str(out), *args],
                   cwd=ROOT, env=env, timeout_s=TIMEOUT_S, program="torchrun")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert (out / "trace.json").is_file() and (out / "timeline.png").stat().st_size > 1000
    codec = args[args.index("--comm") + 1] if "--comm" in args else "fp16"
    assert report["world_size"] == 2 and report["balance_strategy"] == "cost" and report["codec"] == codec
    # balance: the mean over the steps after the first of 1 - (max - min) / max of the ranks' compute
    steady = report["balance_per_step"][1:]
    assert len(report["balance_per_step"]) == report["steps"]
    assert report["balance"] == pytest.approx(statistics.fmean(steady))
    # two ranks: a step's idle share is (max - min) / (2 max) = (1 - balance) / 2; the run's is their
    # mean weighted by the slower rank's compute, so it lies between the extremes
    assert (1 - max(steady)) / 2 - 1e-9 <= report["idle_fraction"] <= (1 - min(steady)) / 2 + 1e-9
    # communication beyond waiting for the slower rank is a part of all blocked communication
    assert 0.0 <= report["comm_fraction"] <= report["blocked_fraction"] < 1.0
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert all(r["median_step_s"] > 0 and r["median_compute_s"] > 0 for r in report["per_rank"])
    if report["sync"]["mode"] == "step":
        assert report["comm_raw_bytes_per_step"] > 0  # the buckets went through poise's hook
    return report


def _union_gradient(batches: list[list[int]]) -> dict[str, torch.Tensor]:
    """One process: the mean loss over the whole step's batch (both ranks' samples together)."""
    seqs, model = toy.make_sequences(), toy.make_model()
    toy.mean_loss(model, toy.collate([(i, seqs[i]) for i in batches])).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _check_exact_first_step(out: Path) -> None:
    """The reduced gradient of the first optimizer step equals the single-process one: per
    micro-batch the gradient of the union of both ranks' batches, averaged over micro-batches
    (the session's accumulation); an unweighted average of the ranks' gradients would not."""
    saved = [torch.load(out / f"first_step_rank{r}.pt") for r in (0, 1)]
    micro = list(zip(saved[0]["batches"], saved[1]["batches"], strict=True))
    terms = toy.lengths_and_terms(toy.make_sequences())[1]
    assert any(terms[a].sum() != terms[b].sum() for a, b in micro)  # unequal loss terms: weighting matters
    expected = {n: torch.zeros_like(g) for n, g in saved[0]["grads"].items()}
    naive = {n: torch.zeros_like(g) for n, g in saved[0]["grads"].items()}
    for a, b in micro:
        for n, g in _union_gradient(a + b).items():
            expected[n] += g / len(micro)
        for one in (a, b):
            for n, g in _union_gradient(one).items():
                naive[n] += g / (2 * len(micro))
    for name, reference in expected.items():
        for rank in (0, 1):
            torch.testing.assert_close(saved[rank]["grads"][name], reference, rtol=1e-4, atol=1e-6)
    assert max(float((naive[n] - expected[n]).abs().max()) for n in expected) > 1e-4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_strategy(tmp_path, accumulate):
    """Two epochs of 7 steps: the second trains too (Lightning's set_epoch reaches the
    session's sampler; before, every epoch after the first ran no batch)."""
    report = _launch("lightning_train.py", tmp_path, "--accumulate", str(accumulate), "--epochs", "2")
    _check_exact_first_step(tmp_path)
    lightning = report["lightning"]
    # with accumulation each epoch's 7th batch steps alone: 4 optimizer steps an epoch
    assert report["steps"] == 14 and lightning["global_step"] == (14 if accumulate == 1 else 8)
    assert lightning["epochs"] == 2 and "val_loss" in lightning["metrics"]  # the validation loader ran, untouched
    if accumulate == 1:  # (with accumulation, half the steps send nothing: the median ratio says less)
        assert report["compression_ratio"] == pytest.approx(2.0)
    checkpoint = torch.load(next((tmp_path / "checkpoints").glob("*.ckpt")), weights_only=False)
    assert checkpoint["poise"]["world_size"] == 2 and checkpoint["poise"]["steps_done"] == 14


def test_accelerate_attach(tmp_path):
    report = _launch("accelerate_train.py", tmp_path, "--steps", "6")
    _check_exact_first_step(tmp_path)
    assert report["steps"] == 6 and report["accelerate"]["distributed_type"] == "MULTI_CPU"
    assert report["compression_ratio"] == pytest.approx(2.0)
    assert report["comm_wire_bytes_per_step"] == pytest.approx(report["comm_raw_bytes_per_step"] / 2)


@pytest.mark.parametrize("script", ["accelerate_train.py", "lightning_train.py"])
def test_adapters_run_diloco(tmp_path, script):
    """Session(sync=...) through each adapter: DiLoCo every 3 steps sends nothing on inner steps
    (the median step's bytes are 0) and the model at each outer step (the mean is not). No
    per-step codec: DiLoCo reduces no gradient, so comm='fp16' would be refused (issue 57, item 3)."""
    report = _launch(script, tmp_path, "--sync", "diloco", "--inner-steps", "3", "--comm", "none")
    # a last, partial round is synchronized too (at the last step, or at finish()): the ranks end alike
    assert report["sync"]["mode"] == "diloco" and report["sync"]["outer_steps"] == -(-report["steps"] // 3)
    assert report["comm_wire_bytes_per_step"] == 0 and report["comm_wire_bytes_mean_per_step"] > 0
