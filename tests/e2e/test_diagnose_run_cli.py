"""``poise diagnose run`` and ``poise diagnose host`` through the CLI, and ``poise bench diagnose``
on a CI-sized scale (few steps, no emulated cluster: ``tests/cluster`` has the slow link)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e

SMALL = ["--max-seq-len", "64", "--task.d_model", "32", "--task.num_layers", "1", "--task.num_heads", "2"]


@pytest.mark.timeout(300)
def test_diagnose_bench_diagnoses_each_job_with_every_rule(tmp_path, cache_dir):
    """The bench's path in ``make test``: two jobs, each diagnosed by every rule. Whether each
    cause is found is a figure of a quiet machine: the long test below and the bench itself."""
    proc = run_poise("bench", "diagnose", "--steps", "6", "--jobs", "clean,slow-rank", "--out", str(tmp_path), "--",
                     "--task.cache_dir", str(cache_dir), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jobs diagnosed as injected" in proc.stdout
    rows = {r["job"]: r for r in json.loads((tmp_path / "diagnose.json").read_text())["jobs"]}
    assert set(rows) == {"clean", "slow-rank"}
    assert set(rows["slow-rank"]["verdicts"]) == set(rows["clean"]["verdicts"]) >= {"straggler", "cpu_contention"}


@pytest.mark.long(covered_by="tests/e2e/test_diagnose_run_cli.py::test_diagnose_bench_diagnoses_each_job_with_every_rule")
def test_diagnose_bench_finds_each_injected_cause(tmp_path, cache_dir):
    # the bench's own model: a smaller one computes for ~2 ms a step, within a shared machine's noise
    proc = run_poise("bench", "diagnose", "--steps", "30", "--data-delay-s", "0.1",
                     "--jobs", "clean,slow-rank,slow-data,crowded,aggressive-replan", "--out", str(tmp_path), "--",
                     "--task.cache_dir", str(cache_dir), timeout_s=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jobs diagnosed as injected" in proc.stdout
    data = json.loads((tmp_path / "diagnose.json").read_text())
    rows = {r["job"]: r for r in data["jobs"]}
    assert set(rows) == {"clean", "slow-rank", "slow-data", "crowded", "aggressive-replan"}
    for name in ("slow-rank", "slow-data", "crowded"):
        assert rows[name]["found"], (name, rows[name]["verdicts"])
    assert rows["slow-rank"]["verdicts"]["straggler"] == "problem"
    straggler = next(f for f in rows["slow-rank"]["findings"] if f["rule"] == "straggler")
    assert straggler["rank"] == 1
    assert rows["clean"]["problems"] == [], rows["clean"]["verdicts"]
    # both ranks on one CPU: each thread off it about half its compute, neither ranked worse than the other
    crowded = next(f for f in rows["crowded"]["findings"] if f["rule"] == "cpu_contention")
    assert crowded["rank"] is None and max(crowded["evidence"]["on_cpu_share_per_rank"]) < 0.6
    # emulated slowness (sleeping) stands for a slower chip: its sleeps are not a thread waiting for a core
    assert rows["slow-rank"]["verdicts"]["cpu_contention"] != "problem"
    # every rule ran on every job; a re-plan job with 30 steps re-planned every step
    assert all(set(r["verdicts"]) == set(rows["clean"]["verdicts"]) for r in rows.values())
    assert next(f for f in rows["aggressive-replan"]["findings"]
                if f["rule"] == "replan_oscillation")["evidence"]["replans"] >= 20


def test_diagnose_run_prints_findings_and_json(tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = run_poise("train", "--task", "code-lm", "--nproc", "2", "--steps", "12", "--batch-size", "4", *SMALL,
                     "--task.cache_dir", str(cache_dir), "--faults.data_delay_s", "0.2",
                     "--diagnostics.progress", "false", "--diagnostics.plot", "false", "--out", str(out), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = run_poise("diagnose", "run", str(out), timeout_s=60)
    assert table.returncode == 0, table.stderr
    assert "input_pipeline" in table.stdout and "problem" in table.stdout and "num_workers" in table.stdout
    as_json = run_poise("diagnose", "run", str(out), "--json", timeout_s=60)
    findings = json.loads(as_json.stdout)
    pipeline = next(f for f in findings if f["rule"] == "input_pipeline")
    assert pipeline["verdict"] == "problem" and min(pipeline["evidence"]["data_share_per_rank"]) >= 0.2
    assert findings[0]["verdict"] == "problem"  # worst first
    # a damaged timeline is one line, exit 2
    (out / "timeline.npz").write_bytes((out / "timeline.npz").read_bytes()[:100])
    bad = run_poise("diagnose", "run", str(out), timeout_s=60)
    assert bad.returncode == 2 and "not a readable poise timeline" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_diagnose_run_refuses_a_directory_without_a_run(tmp_path):
    proc = run_poise("diagnose", "run", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2 and "report.json: no such file" in proc.stderr


def test_diagnose_host_runs_here_read_only(tmp_path):
    proc = run_poise("diagnose", "host", "--json", timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    for name in ("net.core.rmem_max", "net.core.wmem_max", "net.ipv4.tcp_slow_start_after_idle",
                 "net.ipv4.tcp_window_scaling", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL debug"):
        assert name in checks, sorted(checks)
        assert checks[name]["command"] and checks[name]["verdict"] in ("ok", "warn", "info")
    assert any(n.startswith("CPU threads per worker") for n in checks)
    assert any(n.startswith("mtu") for n in checks)
    table = run_poise("diagnose", "host", timeout_s=60)
    assert table.returncode == 0 and "read-only" in table.stdout
