"""``poise bench network`` end to end on real namespaces: a tiny model, two link rates' worth of rows."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(340)  # its command's own limit and the cluster's set-up: over the default 120 s
def test_network_bench_runs_busbw_and_training_on_a_shaped_cluster(cluster_support, state_dir, tmp_path):
    proc = run_poise("bench", "network", "--links", "1gbit", "--runs", "ddp,sign+hierarchical", "--steps", "4",
                     "--eval-every", "2", "--busbw-bytes", "1M", "--out", str(tmp_path), "--",
                     "--task", "digits", "--batch-size", "8", timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs torch PowerSGD" in proc.stdout and "vs line rate" in proc.stdout
    data = json.loads((tmp_path / "network.json").read_text())
    assert {r["op"] for r in data["busbw"]} == {"all_reduce", "poise-ring", "poise-hierarchical"}
    assert all(r["busbw_gbit_per_s"] > 0 for r in data["busbw"])
    runs = {r["run"]: r for r in data["training"]}
    assert set(runs) == {"ddp", "sign+hierarchical"}
    assert runs["ddp"]["vs_ddp"] == pytest.approx(1.0)
    # time to accuracy: ddp's own final loss is the target, reached at its last evaluation
    assert data["target_eval_loss"] == runs["ddp"]["final_eval_loss"]
    assert [p["step"] for p in runs["ddp"]["eval_curve"]] == [2, 4]
    assert runs["ddp"]["time_to_target_s"] == pytest.approx(runs["ddp"]["eval_curve"][-1]["train_s"])
    assert runs["ddp"]["speedup_vs_ddp"] == pytest.approx(1.0)
    assert runs["sign+hierarchical"]["steps"] <= 6  # 50 % more steps at most, stopped at the target
    assert all(r["median_step_s"] > 0 and r["tokens_per_s"] > 0 for r in runs.values())
    # ddp's flat all-reduce spans the nodes: every rank's bytes count as crossing them (the
    # bench's cluster: 2 nodes x 2 workers); hierarchical counts only the leaders' compressed
    # node sums: 2 nodes, 1-bit payloads of the whole model
    assert runs["ddp"]["inter_node_mb_per_step"] == pytest.approx(4 * runs["ddp"]["wire_mb_per_step"])
    assert 0 < runs["sign+hierarchical"]["inter_node_mb_per_step"] < runs["ddp"]["wire_mb_per_step"] / 10


def test_network_bench_rejects_a_bad_rate_before_starting(tmp_path):
    proc = run_poise("bench", "network", "--links", "fast", "--out", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2 and "fast" in proc.stderr and "\n" not in proc.stderr.strip()
