"""``poise bench auto``'s pure parts: its flags, the recovery after a change of speed, and the
summary of runs into medians and ratios (the jobs themselves are real ``poise train`` runs)."""

import argparse

import numpy as np
import pytest

from poise.bench import auto


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    auto.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_the_defaults_are_five_scenarios_over_three_seeds():
    scenarios, seeds = auto.parse(_args())
    assert [s.key for s in scenarios] == ["S2", "S9", "S1", "S7", "S3"] and seeds == [0, 1, 2]
    s7 = auto.SCENARIOS["S7"]
    assert "1:0.5@50-100" in s7.flags(150) and s7.changes(150) == (50, 100)
    assert list(s7.runs()) == ["ddp", "auto", "dynamic"]
    assert s7.runs()["ddp"] == ("--balance", "static", "--codec", "none")  # plain DDP, whatever poise would decide
    assert list(auto.SCENARIOS["S9"].runs()) == ["ddp", "auto", "cost", "dynamic"]


@pytest.mark.parametrize(("flag", "value", "match"), [
    ("scenarios", "S1,S99", "distinct scenarios"), ("scenarios", "S1,S1", "distinct scenarios"),
    ("seeds", "0,x", "--seeds"), ("seeds", "-1", "--seeds"), ("seeds", "", "--seeds"),
    ("extra_steps", float("inf"), "--extra-steps"), ("steps", 0, "--steps"),
])
def test_bad_flags_are_one_line_naming_the_flag(flag, value, match):
    with pytest.raises(ValueError, match=match):
        auto.parse(_args(**{flag: value}))


def test_recovery_counts_the_steps_until_three_steps_are_balanced_again():
    balances = np.array([1.0] * 10 + [0.5, 0.6, 0.9, 0.97, 0.96, 0.98, 0.5, 0.97])
    assert auto.recovery_steps(balances, 10) == 2  # steps 12-14: median 0.96
    assert auto.recovery_steps(balances, 0) == 0
    assert auto.recovery_steps(np.array([0.5] * 8), 2) is None


def _row(scenario, run, seed, time_s, tokens=1000.0):
    return {"scenario": scenario, "run": run, "seed": seed, "command": f"poise train {run}", "time_to_target_s": time_s,
            "tokens_to_target": tokens, "tokens_per_s": 10.0, "balance": 0.9, "padding_waste": 0.1,
            "final_eval_loss": 3.0, "recovered_after_steps": [2], "replan_share": 0.004}


def test_the_summary_gives_medians_ranges_and_auto_against_ddp_and_the_best_of_the_grid():
    rows = [_row("S2", "ddp", s, t) for s, t in enumerate((100.0, 110.0, 90.0))]
    rows += [_row("S2", "auto", s, t, 1020.0) for s, t in enumerate((50.0, 40.0, 60.0))]
    rows += [_row("S2", "dynamic", s, t) for s, t in enumerate((48.0, 47.0, None))]
    rows += [_row("S2", "cost", s, None) for s in range(3)]
    table = {r["run"]: r for r in auto.summarize(rows)}
    assert table["ddp"]["time_to_target_s"] == 100.0 and table["ddp"]["time_to_target_s_range"] == [90.0, 110.0]
    assert table["auto"]["speedup_vs_ddp"] == pytest.approx(2.0)
    assert table["auto"]["tokens_vs_ddp"] == pytest.approx(1.02)
    assert table["auto"]["best_hand_picked"] == "dynamic" and table["auto"]["vs_best"] == pytest.approx(47.5 / 50)
    assert table["dynamic"]["reached"] == 2 and table["cost"]["reached"] == 0 and "vs_best" not in table["cost"]
    assert table["cost"]["time_to_target_s"] is None and "speedup_vs_ddp" not in table["cost"]
    assert table["auto"]["replan_share"] == pytest.approx(0.004)


def test_the_docs_table_is_written_from_the_summary():
    rows = [_row("S2", "ddp", 0, 100.0), _row("S2", "auto", 0, 50.0), _row("S2", "cost", 0, None)]
    lines = auto.markdown_table(auto.summarize(rows)).splitlines()
    assert lines[0].startswith("| scenario | run | time to DDP's loss")
    assert lines[3] == ("| S2 | auto | 50.0 (50.0-50.0) | 2.00x | - | 1.00x | 10 | 0.900 | 0.10 | 1/1 |")
    assert lines[4].startswith("| S2 | cost | not reached | - |")


def test_the_decide_page_quotes_its_results_file_whole():
    """One figure per claim: docs/decide.md's table is the one the bench wrote into
    docs/results/bench-auto.json (a page edited by hand, or a file replaced, fails here)."""
    import json

    from tests.conftest import ROOT

    data = json.loads((ROOT / "docs" / "results" / "bench-auto.json").read_text())
    assert data["bench"] == "auto"
    assert auto.markdown_table(auto.summarize(data["runs"])) in (ROOT / "docs" / "decide.md").read_text()
