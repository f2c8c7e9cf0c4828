"""``poise bench balance``'s pure parts: when a run counts as converged, oscillation, run choice."""

from __future__ import annotations

import argparse

import pytest

from poise.bench import balance as bench


def test_converged_is_the_first_step_whose_next_window_has_a_median_at_the_target():
    per_step = [0.5] * 12 + [0.96] + [0.5] * 10 + [0.96] * 20
    # the lone good step 12 does not count; from step 19 on, 6 of the next 10 steps are good
    assert bench.converged_at(per_step, start=10, target=0.95, window=10) == 19
    assert bench.converged_at(per_step, start=30, target=0.95, window=10) == 30
    assert bench.converged_at([0.9] * 40, start=1, target=0.95) is None


def test_a_share_that_goes_up_then_down_is_one_reversal():
    up_down = [{"shares": [0.6, 0.4]}, {"shares": [0.7, 0.3]}, {"shares": [0.65, 0.35]}]
    assert bench.reversals(up_down) == 1
    assert bench.reversals([{"shares": [0.6, 0.4]}, {"shares": [0.6, 0.4]}, {"shares": [0.7, 0.3]}]) == 0


def test_runs_outside_a_to_i_are_refused_before_any_job_starts(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--runs", "c,x", "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match="--runs='c,x': allowed are the letters a-i"):
        bench.run(args)


def test_deadline_figures_are_shares_of_the_planned_micro_batches():
    report = {"replans": [{"shares": [0.6, 0.4]}, {"shares": [0.66, 0.34]}],
              "straggler": [{"mode": "deadline", "micro_planned": 80, "micro_taken_over": 6, "micro_deferred": 2},
                            {"mode": "deadline", "micro_planned": 40, "micro_taken_over": 0, "micro_deferred": 10}]}
    assert bench.deadline_figures(report) == {"rank1_share": 0.34, "taken_over": 0.05, "deferred": 0.1}
    # no re-plan yet: equal shares; delays into plain DDP (mode off) or no straggler state: no deadline figures
    plain = {"replans": [], "straggler": [{"mode": "off", "micro_planned": 8, "micro_taken_over": 0,
                                           "micro_deferred": 0}, None]}
    assert bench.deadline_figures(plain) == {"rank1_share": 0.5, "taken_over": None, "deferred": None}


def test_the_median_row_of_repeats_takes_each_figure_and_counts_never_as_latest():
    rows = [{"run": "c-1", "balance": 0.91, "converged_after_steps": 0, "taken_over": None, "replans": [1]},
            {"run": "c-2", "balance": 0.95, "converged_after_steps": None, "taken_over": None, "replans": []},
            {"run": "c-3", "balance": 0.93, "converged_after_steps": 22, "taken_over": 0.1, "replans": []}]
    row = bench.median_row("c (median of 3)", rows)
    assert row == {"run": "c (median of 3)", "repeats": 3, "balance": pytest.approx(0.93),
                   "converged_after_steps": 22.0, "taken_over": None}
    # never in most repeats: never
    assert bench.median_row("c", rows[1:2] * 2 + rows[:1])["converged_after_steps"] is None
