"""``poise bench scaling`` end to end on a few steps of the small task."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e


def test_scaling_bench_prints_table_and_writes_json(tmp_path):
    proc = run_poise("bench", "scaling", "--task", "digits", "--steps", "6", "--global-batch", "32",
                     "--out", str(tmp_path), timeout_s=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "efficiency" in proc.stdout
    data = json.loads((tmp_path / "scaling.json").read_text())
    runs = {r["kind"]: r for r in data["runs"]}
    assert set(runs) == {"baseline", "strong", "weak"}
    assert runs["baseline"]["workers"] == 1 and runs["baseline"]["global_batch"] == 32
    assert runs["strong"]["workers"] == 2 and runs["strong"]["global_batch"] == 32
    assert runs["weak"]["global_batch"] == 64
    assert runs["baseline"]["efficiency"] == pytest.approx(1.0)
    for r in data["runs"]:
        assert r["throughput_tokens_per_s"] > 0 and r["efficiency"] > 0


def test_scaling_bench_rejects_bad_worker_counts(tmp_path):
    proc = run_poise("bench", "scaling", "--workers", "2,x", "--out", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert "--workers='2,x' is invalid" in proc.stderr


@pytest.mark.long(covered_by="tests/e2e/test_bench_cli.py::test_balance_bench_repeats_are_interleaved_and_get_a_median_row")
@pytest.mark.timeout(450)  # nine 2-worker jobs: ~105 s here, over the default 120 s on a slower CI machine
def test_balance_bench_runs_nine_jobs_and_writes_json(tmp_path, cache_dir):
    proc = run_poise("bench", "balance", "--steps", "4", "--batch-size", "4", "--change-at", "2",
                     "--out", str(tmp_path), "--",
                     "--max-seq-len", "128", "--task.cache_dir", str(cache_dir), "--task.eval_max_samples", "16",
                     "--balance.cold_start_steps", "2", timeout_s=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs ideal" in proc.stdout
    data = json.loads((tmp_path / "balance.json").read_text())
    runs = {r["run"]: r for r in data["runs"]}
    assert set(runs) == {"a-static", "b-cost", "c-dynamic-slow", "d-static-slow", "e-dynamic-change",
                         "f-dynamic-noisy", "g-dynamic-deadline-slow", "h-static-deadline-slow",
                         "i-dynamic-deadline"}
    # deadline steps report the fate of the planned micro-batches; plain steps have none
    assert runs["a-static"]["taken_over"] is None and runs["a-static"]["deferred"] is None
    for name in ("g-dynamic-deadline-slow", "h-static-deadline-slow", "i-dynamic-deadline"):
        assert 0.0 <= runs[name]["taken_over"] <= 1.0 and 0.0 <= runs[name]["deferred"] <= 1.0
    assert runs["h-static-deadline-slow"]["rank1_share"] == 0.5  # static: never re-planned
    assert runs["e-dynamic-change"]["slowdown"][1]["from_step"] == 2
    assert runs["f-dynamic-noisy"]["slowdown"][0]["noise"] == 0.3
    assert runs["c-dynamic-slow"]["slowdown"][1]["speed"] == 0.5
    assert runs["c-dynamic-slow"]["replans"]  # it re-planned after the cold start
    assert runs["b-cost"]["padding_waste"] < runs["a-static"]["padding_waste"]


@pytest.mark.timeout(240)
def test_balance_bench_repeats_are_interleaved_and_get_a_median_row(tmp_path, cache_dir):
    proc = run_poise("bench", "balance", "--runs", "a", "--repeats", "2", "--steps", "3", "--batch-size", "4",
                     "--out", str(tmp_path), "--",
                     "--max-seq-len", "128", "--task.cache_dir", str(cache_dir), "--task.eval_max_samples", "16",
                     timeout_s=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "balance.json").read_text())
    assert [r["run"] for r in data["runs"]] == ["a-static-1", "a-static-2", "a-static (median of 2)"]
    assert (tmp_path / "a-static-2" / "report.json").is_file()
    first, second, median = data["runs"]
    assert median["balance"] == pytest.approx((first["balance"] + second["balance"]) / 2)


def test_codecs_bench_kernel_and_training_tables(tmp_path):
    proc = run_poise("bench", "codecs", "--mbytes", "2", "--repeats", "1", "--warmup", "0", "--kernels", "fp16,sign",
                     "--codecs", "none,topk:ratio=0.25,alone", "--seeds", "2", "--steps", "6", "--out", str(tmp_path),
                     timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vs memcpy" in proc.stdout and "eval acc" in proc.stdout
    data = json.loads((tmp_path / "codecs.json").read_text())
    assert [k["codec"] for k in data["kernels"]] == ["fp16", "sign"]
    assert data["target"] == ["accuracy_delta", -0.003]  # digits: within 0.3 pt
    runs = {r["codec"]: r for r in data["runs"]}
    assert runs["none"]["accuracy_delta"] == 0.0 and runs["none"]["meets_target"]
    topk = runs["topk:ratio=0.25"]
    assert len(topk["seed_accuracy"]) == 2 and topk["accuracy_delta_se"] is not None
    assert 3.5 < topk["compression_ratio"] < 4.1  # fp16 value + 16-bit offset for a quarter of the entries
    # the two seeds are different runs (initial weights, data order)
    assert runs["none"]["seed_loss"][0] != runs["none"]["seed_loss"][1]
    # the reference row: one worker, nothing sent, no target of its own
    assert "meets_target" not in runs["alone"] and "loss_delta_pct" in runs["alone"]
    alone = json.loads((tmp_path / "alone-seed0" / "report.json").read_text())
    assert len(alone["per_rank"]) == 1


def test_codecs_bench_refuses_a_bad_codec_spec_before_running(tmp_path):
    proc = run_poise("bench", "codecs", "--kernels", "", "--codecs", "none,topk:ratio", "--out", str(tmp_path),
                     timeout_s=60)
    assert proc.returncode != 0
    assert "option 'ratio' of 'topk:ratio' is not KEY=VALUE" in proc.stderr
    assert not (tmp_path / "none").exists()


def test_partition_bench_compares_methods_against_brute_force(tmp_path, cache_dir):
    # --run-steps 0: the running pipeline is covered by tests/e2e/test_pipeline_cli.py
    proc = run_poise("bench", "partition", "--stages", "2,3", "--layers", "2", "--d-model", "32", "--max-seq-len", "64",
                     "--batch-size", "4", "--micro-batches", "2", "--repeats", "1", "--cases", "30",
                     "--run-steps", "0", "--cache-dir", str(cache_dir), "--out", str(tmp_path), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "random cost vectors" in proc.stdout and "vs optimal" in proc.stdout
    data = json.loads((tmp_path / "partition.json").read_text())
    rows = data["code_lm"]["rows"]
    assert {(r["stages"], r["method"]) for r in rows} == {
        (p, m) for p in (2, 3) for m in ("exact", "uniform", "parameters", "greedy")
    }
    assert all(r["vs_optimal"] == pytest.approx(1.0) for r in rows if r["method"] == "exact")
    assert data["code_lm"]["profile"]["names"] == ["embedding", "block0", "block1", "head"]
    summary = {r["method"]: r for r in data["random"]["summary"]}
    assert summary["exact"]["optimal"] == 30 and summary["exact"]["vs_optimal_worst"] == pytest.approx(1.0)
    assert all(summary[m]["vs_optimal_worst"] >= 1.0 for m in summary)
    assert "running" not in data


def test_checkpoint_bench_rejects_unknown_runs(tmp_path):
    proc = run_poise("bench", "checkpoint", "--runs", "b-sync-full,z", "--out", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert "--runs: z unknown: allowed are a-none, b-sync-full" in proc.stderr


def test_a_bench_command_runs_where_it_is_told_and_its_refusal_reaches_the_log(tmp_path):
    """poise.launch.command.start (every bench job): the command runs in the given directory
    (it reads its config file there), its output appended to its log, its exit code read back."""
    from poise.launch.command import start

    (tmp_path / "bad.toml").write_text("[train]\nsteps = -7\n")
    log = tmp_path / "job.log"
    for flags in (["--config", "bad.toml"], ["--steps", "0"]):
        proc = start(["train", *flags, "--out", "here"], log, append=True, cwd=tmp_path)
        assert proc.wait(timeout=120) == 2 and proc.poll() == 2
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith("poise train: error: ") for line in lines), lines
    assert "train.steps=-7" in lines[0] and "train.steps=0" in lines[1], lines
    assert not (tmp_path / "here").exists()  # refused before anything is made
