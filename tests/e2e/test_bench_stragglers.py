"""CI's slice of ``poise bench stragglers`` (issue 14): one delay model, plain DDP and
deadline steps on 2 workers, and an epoch of digits with every sample trained once; and the
training CLI's one-line refusals for straggler settings."""

from __future__ import annotations

import json

import pytest

from poise.diagnostics.timeline import column, load_table
from tests.conftest import run_poise

pytestmark = pytest.mark.e2e


@pytest.mark.long(covered_by="tests/e2e/test_bench_stragglers.py::"
                        "test_the_modes_without_delays_are_measured_against_the_delay_free_run")
@pytest.mark.timeout(300)
def test_bench_stragglers_slice_writes_its_rows(tmp_path):
    proc = run_poise("bench", "stragglers", "--worlds", "2", "--models", "bernoulli", "--modes", "ddp,deadline",
                     "--seeds", "1", "--steps", "8", "--batch-size", "16", "--out", str(tmp_path), timeout_s=290)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    data = json.loads((tmp_path / "stragglers.json").read_text())
    assert (data["steps"], data["batch_size"], data["micro_batches"], data["seeds"]) == (8, 16, 8, 1)
    runs = {r["run"]: r for r in data["runs"]}
    assert set(runs) == {"w2-delay-free-s0", "w2-bernoulli-ddp-s0", "w2-bernoulli-deadline-s0",
                         "w2-delay-free-after-bernoulli-s0"}
    for row in runs.values():
        assert {"run", "world_size", "delay_model", "throughput_vs_delay_free", "loss_vs_delay_free",
                "p99_step_s"} <= set(row)
        assert row["samples_duplicated"] == 0
        assert row["throughput_vs_delay_free"] > 0
        assert 0 < row["cores_busy"] <= 1 and row["cpu_ms_per_sample"] > 0  # from the job's CPU trace
        # from the ranks' timelines: their compute, and what their processes spent besides
        assert row["compute_cpu_ms_per_sample"] > 0 and 0 < row["cpu_outside_compute"] < 0.5
    # deadline steps time their micro-batches' own compute: without the stalls and claims between them
    table = load_table(tmp_path / "w2-bernoulli-deadline-s0" / "timeline.npz")
    wall = column(table, "compute_wall_s")
    assert 0 < wall.sum() < column(table, "compute_s").sum()
    assert column(table, "compute_cpu_s").sum() <= 1.02 * wall.sum()  # one thread: on a CPU at most all along
    # throughput over the steps after the first, on the job's time in steps: the report's steady figure
    report = json.loads((tmp_path / "w2-bernoulli-deadline-s0" / "report.json").read_text())
    assert runs["w2-bernoulli-deadline-s0"]["throughput_samples_per_s"] == pytest.approx(
        report["steady_throughput_samples_per_s"])
    # the reference: the delay-free runs around the delayed ones, interpolated in time (each its own)
    assert runs["w2-delay-free-s0"]["throughput_vs_delay_free"] == 1.0
    assert runs["w2-delay-free-after-bernoulli-s0"]["throughput_vs_delay_free"] == 1.0
    summary = {(r["delay_model"], r["mode"]): r for r in data["summary"]}
    assert summary[("none", "delay-free")]["throughput_pooled_vs_delay_free"] == 1.0
    free = [runs[n]["throughput_samples_per_s"] for n in ("w2-delay-free-s0", "w2-delay-free-after-bernoulli-s0")]
    assert summary[("bernoulli", "deadline")]["throughput_pooled_vs_delay_free"] == pytest.approx(
        runs["w2-bernoulli-deadline-s0"]["throughput_samples_per_s"] / (sum(free) / 2))
    (check,) = data["epoch_checks"]
    assert check["trained"] == check["distinct"] > 1000 and check["samples_duplicated"] == 0
    assert {p["delay_model"] for p in data["predictors"]} == {"bernoulli"}


@pytest.mark.timeout(200)
def test_the_modes_without_delays_are_measured_against_the_delay_free_run(tmp_path):
    # --models none: deadline steps with nothing to tolerate, what the mode costs or saves by itself
    proc = run_poise("bench", "stragglers", "--worlds", "2", "--models", "none", "--modes", "deadline", "--seeds", "1",
                     "--steps", "6", "--batch-size", "16", "--no-epoch-check", "--out", str(tmp_path), timeout_s=190)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "none = no delays" in proc.stdout
    data = json.loads((tmp_path / "stragglers.json").read_text())
    assert data["models"] == {"none": "none"}
    row = next(r for r in data["runs"] if r["run"] == "w2-none-deadline-s0")
    assert (row["delay_model"], row["mode"], row["samples_duplicated"]) == ("none", "deadline", 0)
    assert row["throughput_vs_delay_free"] > 0 and row["compute_cpu_ms_per_sample"] > 0
    # the tables recomputed from the directory read the run back as the same model and mode
    again = run_poise("bench", "stragglers", "--from", str(tmp_path), timeout_s=60)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = json.loads((tmp_path / "stragglers.json").read_text())["runs"]
    assert {(r["run"], r["delay_model"], r["mode"]) for r in rows} == {(r["run"], r["delay_model"], r["mode"])
                                                                       for r in data["runs"]}


@pytest.mark.parametrize(("flags", "message"), [
    (["--straggler", "sometimes"], "straggler.mode='sometimes' is unknown: allowed are off, deadline, deadline+stale"),
    (["--delay", "bernoulli:p=3"], "straggler.delay 'bernoulli:p=3': p must be in [0, 1] and x in [0, 100]"),
    (["--straggler", "deadline", "--train.accum_steps", "2"], "train.accum_steps=2 with straggler.mode='deadline'"),
])
def test_bad_straggler_settings_are_one_line(tmp_path, flags, message):
    proc = run_poise("train", "--task", "digits", "--steps", "2", "--nproc", "1", *flags, "--out", str(tmp_path / "o"),
                     timeout_s=120)
    assert proc.returncode != 0
    assert message in proc.stderr.strip().splitlines()[-1]
