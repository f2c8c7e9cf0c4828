"""``poise demo``'s pure parts: the jobs it plans, the ratio rows of its table and the credit line, the
side-by-side plot.

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
def test_the_slow_rank_runs_differ_only_in_the_balancing():
    args = _args(network_reason="--network off")
    (comparison,) = demo.comparisons(args)
    assert [run.name for run in comparison.runs] == ["static", "auto", "dynamic"]
    flags = [run.flags for run in comparison.runs]
    assert [f[-2:] for f in flags] == [["--balance", "static"], ["--balance", "auto"], ["--balance", "dynamic"]]
    assert flags[0][:-2] == flags[1][:-2] == flags[2][:-2]
    assert "--rank-speed" in flags[0] and flags[0][flags[0].index("--rank-speed") + 1] == "1:0.5"


@pytest.mark.timeout(30)
def test_the_network_comparison_runs_ddp_against_the_compressed_flags_on_the_emulated_cluster():
    args = _args(network_reason=None)
    _, comparison = demo.comparisons(args)
    baseline, compressed = (run.flags for run in comparison.runs)
    assert baseline[-2:] == ["--codec", "none"]
    assert tuple(compressed[-len(demo.COMPRESSED_FLAGS):]) == demo.COMPRESSED_FLAGS
    for flags in (baseline, compressed):
        assert flags[flags.index("--cluster") + 1] == "2:1" and flags[flags.index("--link") + 1] == "1gbit"


@pytest.mark.timeout(30)
def test_network_off_is_its_own_reason():
    assert demo.network_reason("off") == "--network off"


def _row(comparison: demo.Comparison, index: int, **figures: float) -> dict[str, object]:
    keys = [key for key, _, _ in demo.METRICS]
    run = comparison.runs[index]
    return {"comparison": comparison.key, "title": comparison.title, "role": "run" if index else "baseline",
            "name": run.name, "run": run.label, **dict.fromkeys(keys, 1.0), **figures}


@pytest.mark.timeout(30)
def test_ratio_rows_are_each_run_over_the_baseline_then_each_step_over_the_one_before():
    (slow,) = demo.comparisons(_args(network_reason="--network off"))
    results = [_row(slow, 0, throughput_tokens_per_s=1000.0, idle_fraction=0.0),
               _row(slow, 1, throughput_tokens_per_s=2000.0, idle_fraction=0.2),
               _row(slow, 2, throughput_tokens_per_s=3000.0, idle_fraction=0.1)]
    rows = demo.comparison_rows([slow], results)
    assert [r["role"] for r in rows] == ["baseline", "run", "run", "ratio", "ratio", "ratio"]
    ratios = {r["run"]: r for r in rows if r["role"] == "ratio"}
    assert list(ratios) == ["auto / static", "dynamic / static", "dynamic / auto"]
    assert ratios["auto / static"]["throughput_tokens_per_s"] == pytest.approx(2.0)
    assert ratios["dynamic / static"]["throughput_tokens_per_s"] == pytest.approx(3.0)
    assert ratios["dynamic / auto"]["throughput_tokens_per_s"] == pytest.approx(1.5)
    assert ratios["auto / static"]["idle_fraction"] is None  # nothing to compare with: no ratio
    assert ratios["dynamic / auto"]["idle_fraction"] == pytest.approx(0.5)
    # the two steps multiply to the whole gain, and the credit line says so
    line = demo.credit_line(rows)
    assert "no settings (auto: DDP's samples split by speed and length) 2.00x" in line
    assert "a further 1.50x" in line and "3.00x in all" in line


@pytest.mark.timeout(30)
def test_a_two_run_comparison_has_one_ratio_row_and_no_credit_line():
    _, link = demo.comparisons(_args(network_reason=None))
    rows = demo.comparison_rows([link], [_row(link, 0, median_step_s=0.6), _row(link, 1, median_step_s=0.2)])
    (ratio,) = [r for r in rows if r["role"] == "ratio"]
    assert ratio["run"] == "compressed / ddp" and ratio["median_step_s"] == pytest.approx(1 / 3)
    assert demo.credit_line(rows) == ""


@pytest.mark.timeout(30)
def test_results_that_do_not_match_the_runs_are_refused():
    (slow,) = demo.comparisons(_args(network_reason="--network off"))
    with pytest.raises(ValueError, match="do not match"):
        demo.comparison_rows([slow], [_row(slow, 0), _row(slow, 2), _row(slow, 1)])
    with pytest.raises(ValueError, match="4 results for 3 runs"):
        demo.comparison_rows([slow], [_row(slow, 0), _row(slow, 1), _row(slow, 2), _row(slow, 2)])


@pytest.mark.timeout(60)
def test_side_by_side_timelines_are_written(tmp_path):
    rng = np.random.default_rng(0)
    tables = []
    for ranks in (2, 2, 2, 3, 3):
        table = np.abs(rng.standard_normal((ranks, 6, len(FIELDS)))) * 0.1
        tables.append(table)
    path = plot_timelines([(f"run {i}", t) for i, t in enumerate(tables)], tmp_path / "compare.png",
                          title="t", groups=[(0, 1, 2), (3, 4)])  # the demo's groups: three runs, then two
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(path).size
    assert height > 0.5 * width, (width, height)  # a row of panels per comparison: readable at a page's width
    with pytest.raises(ValueError, match="no runs"):
        plot_timelines([], tmp_path / "none.png")
