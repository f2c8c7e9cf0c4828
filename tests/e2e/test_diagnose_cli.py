"""``poise diagnose busbw`` end to end: the CLI launches 2 workers that measure small sizes."""

from __future__ import annotations

import json
import math

import pytest

from poise.cli import main
from poise.diagnostics.busbw import OPS, bus_factor
from tests.conftest import run_poise

pytestmark = pytest.mark.e2e


def test_busbw_measures_every_op_and_writes_table_json_and_plot(tmp_path):
    proc = run_poise("diagnose", "busbw", "--nproc", "2", "--min-bytes", "4K", "--max-bytes", "16K",
                     "--warmup", "1", "--repeats", "2", "--link", "1gbit", "--out", str(tmp_path), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "busbw, GB/s" in proc.stdout and "of line rate" in proc.stdout
    data = json.loads((tmp_path / "busbw.json").read_text())
    assert data["world_size"] == 2 and data["link_bytes_per_s"] == 125e6
    results = data["results"]
    assert {(r["op"], r["requested_bytes"]) for r in results} == {(op, s) for op in OPS for s in (4096, 16384)}
    for r in results:
        assert not r["error"], r  # gloo runs all of them
        assert r["time_s"] > 0 and r["size_bytes"] == r["requested_bytes"]
        assert math.isclose(r["algbw_bytes_per_s"], r["size_bytes"] / r["time_s"])
        assert math.isclose(r["busbw_bytes_per_s"], r["algbw_bytes_per_s"] * bus_factor(r["op"], 2))
    assert {b["op"] for b in data["best"]} == set(OPS)
    for b in data["best"]:
        assert math.isclose(b["line_rate_ratio"], b["busbw_bytes_per_s"] / 125e6)
    assert (tmp_path / "busbw.png").read_bytes()[:4] == b"\x89PNG"


def test_busbw_rejects_bad_sizes_before_launching(tmp_path, capsys):
    assert main(["diagnose", "busbw", "--max-bytes", "lots", "--out", str(tmp_path)]) == 2
    assert "size 'lots' is invalid" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing was started
