"""``poise pipeline`` end to end: torch's launcher, two gloo stages, the report."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e


def test_pipeline_trains_two_stages_and_reports_measured_vs_predicted(tmp_path, cache_dir):
    proc = run_poise("pipeline", "--stages", "2", "--schedule", "gpipe", "--micro-batches", "2", "--steps", "3",
                     "--batch-size", "4", "--max-seq-len", "64", "--task.num_layers", "2", "--task.d_model", "32",
                     "--task.cache_dir", str(cache_dir), "--pipeline.profile_repeats", "1",
                     "--pipeline.warmup_steps", "1", "--out", str(tmp_path), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "measured" in proc.stdout and "advice" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    plan = report["plan"]
    assert report["num_stages"] == 2 and report["steps"] == 3 and report["schedule"] == "gpipe"
    assert plan["boundaries"][0] == 0 and plan["boundaries"][-1] == 4
    assert [name for stage in plan["stage_layers"] for name in stage] == ["embedding", "block0", "block1", "head"]
    assert len(report["measured_stage_s"]) == len(report["predicted_stage_s"]) == 2
    assert all(t > 0 for t in report["measured_stage_s"])
    assert 0 < report["measured_balance"] <= 1 and 0 < report["predicted_balance"] <= 1
    assert report["balance_gap"] == pytest.approx(abs(report["measured_balance"] - report["predicted_balance"]))
    assert plan["bubble_fraction"] == pytest.approx(1 / 3)
    assert len(report["loss_curve"]) == 3 and report["loss_unit"] == "bits/byte"


def test_pipeline_rejects_bad_input_in_one_line(tmp_path):
    proc = run_poise("pipeline", "--stages", "9", "--task.num_layers", "2", "--out", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "poise pipeline: error: 9 stages need at least as many layers, but code-lm has 4 "
        "(embedding, 2 blocks, head)"
    )
