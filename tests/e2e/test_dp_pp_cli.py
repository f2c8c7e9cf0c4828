"""``poise pipeline --stages 2 --dp 2`` end to end: torch's launcher, 4 gloo workers (2 stages x 2
replicas, fp16 on the replicas' all-reduce), evaluations, the report and its replica table."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e

SMALL = ("--micro-batches", "2", "--max-seq-len", "64", "--task.num_layers", "2", "--task.d_model", "32",
         "--pipeline.profile_repeats", "1", "--pipeline.warmup_steps", "1")


def test_dp_x_pp_trains_two_replicas_of_two_stages_and_reports_each(tmp_path, cache_dir):
    proc = run_poise("pipeline", "--stages", "2", "--dp", "2", "--codec", "fp16", "--comm.start_step", "0",
                     "--steps", "3", "--batch-size", "3", *SMALL, "--train.eval_every", "2",
                     "--task.eval_max_samples", "6", "--task.cache_dir", str(cache_dir), "--out", str(tmp_path),
                     timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 data-parallel replicas (fp16 on dp)" in proc.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["num_stages"], report["dp_size"], report["world_size"]) == (2, 2, 4)
    assert report["config"]["dist"]["nproc"] == 4
    # 3 per data-parallel rank: 6 samples a step, split in whole micro-batches of the 2
    assert [r["samples_per_step"] for r in report["per_dp_rank"]] == [4, 2]
    assert all(len(r["measured_stage_s"]) == 2 and min(r["wire_bytes_per_step"]) > 0 for r in report["per_dp_rank"])
    assert report["dp_compression_ratio"] == 2.0  # fp16 from the first step
    assert [p["step"] for p in report["eval_curve"]] == [2, 3]
    assert math.isfinite(report["eval_loss"]) and report["eval_loss"] == report["eval_curve"][-1]["loss"]
    assert len(report["loss_curve"]) == 3 and len(report["memory"]) == 4
    assert report["comm_inter_node_wire_bytes_per_step"] == 0  # one machine: nothing crosses a node


def test_dp_x_pp_refuses_what_it_cannot_run_in_one_line(tmp_path):
    proc = run_poise("pipeline", "--stages", "2", "--dp", "2", "--batch-size", "1", *SMALL, "--out",
                     str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "poise pipeline: error: train.batch_size=1 per replica (2 samples per step over pipeline.dp_size=2 replicas) "
        "cannot be cut into whole micro-batches: each replica runs pipeline.micro_batches=2 equal ones, so give at "
        "least 2 per replica and a multiple of 2 per step")
