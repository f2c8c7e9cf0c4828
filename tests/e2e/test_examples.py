"""The examples a user starts from: a plain torchrun DDP script, and the same script with poise."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.harness import run_cli

pytestmark = pytest.mark.e2e

EXAMPLES = ROOT / "examples"


def torchrun(script: Path, *args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 --standalone script args`` in a subprocess, bounded."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return run_cli(["--nproc-per-node", "2", "--standalone", str(script), *args], cwd=ROOT, env=env,
                   timeout_s=timeout_s, program="torchrun")


def test_adding_poise_to_the_plain_script_changes_at_most_ten_lines():
    plain = (EXAMPLES / "plain_ddp.py").read_text().splitlines()
    with_poise = (EXAMPLES / "poise_ddp.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(plain, with_poise, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line for line in changed if line.startswith("+")]
    assert len(added) <= 10, "\n".join(changed)


def test_the_plain_script_trains_the_steps_asked_for(tmp_path: Path):
    proc = torchrun(EXAMPLES / "plain_ddp.py", "--steps", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = re.findall(r"^step (\d+) loss (\d+\.\d+)$", proc.stdout, re.MULTILINE)
    assert [int(step) for step, _ in losses] == [1, 5]  # rank 0 alone prints, at its first and 5th step
    first, last = (float(loss) for _, loss in losses)
    assert last < first  # it learns (here 5.93 -> 4.19 nats per byte)


def test_the_poise_script_writes_its_report_with_a_slow_rank_rebalanced(tmp_path: Path):
    proc = torchrun(EXAMPLES / "poise_ddp.py", "--steps", "30", "--rank-speed", "1:0.5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert report["steps"] == 30 and report["balance_strategy"] == "auto"  # no settings
    for key in ("balance", "idle_fraction", "comm_fraction"):
        assert 0.0 <= report[key] <= 1.0
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert report["emulated_slowdown"][1]["speed"] == 0.5
    first, *rest = report["replans"]
    assert first["step"] == 2  # auto re-plans after every step; the first one has one measured step:
    assert first["decision"] == "wait" and first["shares"] == [0.5, 0.5]  # not confident, nothing moves
    assert report["decisions"][0]["knob"] == "balance" and report["decisions"][0]["by"] == "poise"
    assert rest and rest[0]["step"] == 3  # then after every step
