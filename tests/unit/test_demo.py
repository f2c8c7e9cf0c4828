"""``poise demo``'s pure parts: the jobs it plans, the ratio rows of its table, the side-by-side plot.

The demo's real jobs run in ``tests/e2e/test_docs.py`` (``make demo`` is the README's first
command)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from poise.bench import demo
from poise.diagnostics.report import plot_timelines
from poise.diagnostics.timeline import FIELDS


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.timeout(30)
def test_the_slow_rank_pair_differs_only_in_the_balancing():
    args = _args(network_reason="--network off")
    (pair,) = demo.pairs(args)
    baseline, poise = pair.baseline[1], pair.poise[1]
    assert baseline[-2:] == ["--balance", "static"] and poise[-2:] == ["--balance", "dynamic"]
    assert baseline[:-2] == poise[:-2]
    assert "--rank-speed" in baseline and baseline[baseline.index("--rank-speed") + 1] == "1:0.5"


@pytest.mark.timeout(30)
def test_the_network_pair_runs_ddp_against_the_compressed_flags_on_the_emulated_cluster():
    args = _args(network_reason=None)
    _, pair = demo.pairs(args)
    baseline, poise = pair.baseline[1], pair.poise[1]
    assert baseline[-2:] == ["--codec", "none"]
    assert tuple(poise[-len(demo.COMPRESSED_FLAGS):]) == demo.COMPRESSED_FLAGS
    for flags in (baseline, poise):
        assert flags[flags.index("--cluster") + 1] == "2:1" and flags[flags.index("--link") + 1] == "1gbit"


@pytest.mark.timeout(30)
def test_network_off_is_its_own_reason():
    assert demo.network_reason("off") == "--network off"


@pytest.mark.timeout(30)
def test_ratio_rows_are_poise_over_the_baseline():
    keys = [key for key, _, _ in demo.METRICS]
    baseline = {"pair": "p", "comparison": "c", "role": "baseline", "run": "b", **dict.fromkeys(keys, 2.0)}
    poise = {"pair": "p", "comparison": "c", "role": "poise", "run": "q", **dict.fromkeys(keys, 3.0)}
    baseline["idle_fraction"] = 0.0  # nothing to compare with: no ratio
    rows = demo.comparison_rows([baseline, poise])
    assert [r["role"] for r in rows] == ["baseline", "poise", "ratio"]
    ratio = rows[-1]
    assert ratio["balance"] == pytest.approx(1.5) and ratio["median_step_s"] == pytest.approx(1.5)
    assert ratio["idle_fraction"] is None


@pytest.mark.timeout(60)
def test_side_by_side_timelines_are_written(tmp_path):
    rng = np.random.default_rng(0)
    tables = []
    for ranks in (2, 2, 3):
        table = np.abs(rng.standard_normal((ranks, 6, len(FIELDS)))) * 0.1
        tables.append(table)
    path = plot_timelines([(f"run {i}", t) for i, t in enumerate(tables)], tmp_path / "compare.png",
                          title="t", pairs=[(0, 1)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no runs"):
        plot_timelines([], tmp_path / "none.png")
