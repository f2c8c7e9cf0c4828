"""``poise plan`` and ``poise bench plan --published-only`` through the CLI, in this process."""

from __future__ import annotations

import json

import pytest

from poise.cli import main

pytestmark = pytest.mark.e2e


def test_plan_prints_every_configuration_and_writes_plan_json(tmp_path, capsys):
    results = tmp_path / "codecs.json"
    results.write_text(json.dumps({"runs": [{"codec": "fp16", "loss_delta_pct": 0.0},
                                            {"codec": "sign", "loss_delta_pct": 1.0}]}))
    assert main(["plan", "--nodes", "4", "--procs-per-node", "2", "--link", "10gbit", "--intra", "50GB/s",
                 "--params", "1e8", "--step-s", "0.2", "--codecs", "none,fp16,sign,topk", "--bucket-mb", "5,25",
                 "--codec-results", str(results), "--max-loss-increase", "2", "--json", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "recommended (loss within +2%)" in out and "unknown" in out and "embedding" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert len(data["rows"]) == 4 * 4 * 2
    assert data["recommended"]["codec"] in ("none", "fp16", "sign")
    assert data["sources"]["compute"].startswith("measured step 0.2 s")
    assert data["cluster"]["inter"]["bandwidth_bytes_per_s"] == pytest.approx(1.25e9)
    steps = [r["step_s"] for r in data["rows"]]
    assert steps == sorted(steps) and all(s >= 0.2 for s in steps)


@pytest.mark.parametrize(("argv", "message"), [
    (["--nodes", "2", "--link", "fast", "--params", "1e9"], "--link 'fast' is invalid"),
    (["--nodes", "2", "--params", "1e9"], "--link RATE"),
    (["--nodes", "0", "--link", "1gbit", "--params", "1e9"], "--nodes=0"),
    (["--link", "1gbit"], "--params N or --profile DIR"),
    (["--params", "1e9", "--codecs", "zip"], "unknown zip"),
    (["--params", "1e9", "--bucket-mb", "0"], "--bucket-mb"),
    (["--params", "1e9", "--profile", "/nonexistent"], "cannot be read"),
])
def test_plan_rejects_bad_input_in_one_line(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_plan_reads_a_layer_profile(tmp_path, capsys):
    profile = {"names": ["embed", "block", "head"], "time_s": [0.003, 0.03, 0.006], "forward_s": [0.001, 0.01, 0.002],
               "param_bytes": [4_000_000, 16_000_000, 4_000_000]}
    (tmp_path / "report.json").write_text(json.dumps({"profile": profile}))
    assert main(["plan", "--nodes", "2", "--link", "1gbit", "--profile", str(tmp_path), "--codecs", "none"]) == 0
    out = capsys.readouterr().out
    assert "layer profile of 3 layers" in out and "block" in out


def test_bench_plan_published_table(tmp_path, capsys):
    assert main(["bench", "plan", "--published-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "published GB/s" in out and "fit" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    rows = data["h200"]["rows"]
    assert len(rows) == 6 and sum(r["fitted"] for r in rows) == 2
    assert max(abs(r["error"]) for r in rows) <= 0.10
