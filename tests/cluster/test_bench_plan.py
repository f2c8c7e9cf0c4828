"""``poise bench plan`` with one tiny real job on real namespaces: calibrate, predict, run, compare."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(280)  # its command's own limit and the cluster's set-up: over the default 120 s
def test_bench_plan_predicts_and_measures_one_job(cluster_support, state_dir, tmp_path):
    proc = run_poise("bench", "plan", "--links", "1gbit", "--clusters", "2:1", "--codecs", "none", "--collectives",
                     "flat", "--steps", "5", "--warmup-steps", "2", "--out", str(tmp_path), timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted" in proc.stdout and "published GB/s" in proc.stdout
    data = json.loads((tmp_path / "plan-validation.json").read_text())
    (row,) = data["rows"]
    assert row["predicted_s"] > 0 and row["measured_s"] > 0
    assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    assert set(data["calibration"]["busbw"]) == {"local-2", "1gbit-2x1"}
    assert data["summary"]["jobs"] == 1
