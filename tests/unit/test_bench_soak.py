"""The time soak of ``poise bench faults --minutes``: its fault schedule and its accounting
(issue 46). The soak itself runs for minutes; the lead runs it, not the suite."""

from __future__ import annotations

import json

import pytest

from poise.bench.soak import account, fault_schedule, read_record


def test_faults_come_at_the_given_rate_after_the_warmup_and_are_reproducible():
    faults = fault_schedule(20 * 60, 60.0, seed=0, kinds=["kill", "stop"])
    assert faults == fault_schedule(20 * 60, 60.0, seed=0, kinds=["kill", "stop"])
    assert faults != fault_schedule(20 * 60, 60.0, seed=1, kinds=["kill", "stop"])
    assert all(15.0 < f.at_s < 20 * 60 for f in faults)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
    assert {f.kind for f in faults} == {"kill", "stop"} and {f.rank for f in faults} == {0, 1}
    long = fault_schedule(1000 * 60, 60.0, seed=3, kinds=["kill"])
    assert 900 <= len(long) <= 1100  # a Poisson process of rate 1/min over 1000 min: 1000 ± 3 sigma
    assert fault_schedule(10.0, 60.0, seed=0, kinds=["kill"]) == []  # all within the warmup


def test_accounting_counts_lost_in_complete_epochs_and_duplicates_everywhere():
    per_epoch = 6
    record = {0: [0, 1, 2, 3, 4, 5], 1: [5, 4, 3, 2, 1], 2: [0, 1, 1]}
    got = account(record, per_epoch)
    assert got == {"samples": 14, "complete_epochs": 2, "samples_lost": 1, "samples_duplicated": 1}
    assert account({}, per_epoch)["samples"] == 0
    assert account({0: [0, 1]}, per_epoch)["samples_lost"] == 0  # the epoch in progress loses nothing


def test_a_record_cut_short_by_a_killed_worker_is_read_without_its_last_line(tmp_path):
    lines = [json.dumps({"step": s, "epoch": 0, "indices": [2 * s, 2 * s + 1]}) for s in range(3)]
    (tmp_path / "rank-00000.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "epo')
    (tmp_path / "rank-00001.jsonl").write_text(json.dumps({"step": 0, "epoch": 1, "indices": [9]}) + "\n")
    assert read_record(tmp_path) == {0: [0, 1, 2, 3, 4, 5], 1: [9]}


@pytest.mark.parametrize("every", [0.0, -5.0])
def test_a_soak_without_a_positive_rate_is_refused(tmp_path, every):
    import argparse

    from poise.bench import soak

    args = argparse.Namespace(fault_every_s=every, hang_s=120.0, out=str(tmp_path), minutes=1.0, reference_minutes=0.0,
                              seed=0)
    with pytest.raises(ValueError, match="must be positive"):
        soak.run(args, ["kill"])
