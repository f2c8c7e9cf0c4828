"""``poise bench stragglers``'s reference: the delay-free runs around each run, interpolated in time."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from poise.bench.cpu import PROC_STAT, cpu_trace, cpu_use
from poise.bench.stragglers import _compare, _cpu_row, _setup, _summary
from poise.diagnostics.timeline import FIELDS, save_table


def _row(name: str, mode: str, finished_s: float, samples_per_s: float, seed: int = 0, micro: int = 8,
         busy: float | None = None, cpu_ms: float | None = None, compute_ms: float | None = None) -> dict:
    curve = [[1000.0 * (i + 1), 3.0 - 0.1 * i] for i in range(12)]
    config = {"train": {"steps": 12, "batch_size": 64}, "straggler": {"micro_batches": micro}}
    return {"run": name, "world_size": 4, "delay_model": "none" if mode == "delay-free" else "lognormal",
            "mode": mode, "seed": seed, "finished_s": finished_s, "throughput_samples_per_s": samples_per_s,
            "cores_busy": busy, "cpu_ms_per_sample": cpu_ms, "compute_cpu_ms_per_sample": compute_ms,
            "cpu_outside_compute": None if compute_ms is None else 0.02, "p50_step_s": 1.0, "p99_step_s": 1.0,
            "deferred_share": 0.0, "samples_duplicated": 0,
            "tokens": curve[-1][0], "_report": {"loss_curve": curve, "config": config},
            "_elapsed_s": [1.0 + i for i in range(12)]}


def test_a_run_between_the_delay_free_runs_is_compared_with_their_speed_at_its_time():
    # the machine slowed from 100 to 80 samples/s over the seed's runs: a run at 90 in the
    # middle is as fast as delay-free, not 10 % slower than the first delay-free run
    rows = [_row("before", "delay-free", 0.0, 100.0), _row("mid", "deadline", 5.0, 90.0),
            _row("late", "ddp", 7.5, 68.0), _row("after", "delay-free", 10.0, 80.0)]
    _compare(rows)
    ratio = {r["run"]: r["throughput_vs_delay_free"] for r in rows}
    assert ratio["mid"] == pytest.approx(1.0) and ratio["late"] == pytest.approx(68.0 / 85.0)
    assert ratio["before"] == 1.0 and ratio["after"] == 1.0


def test_one_delay_free_run_is_the_reference_of_its_seed_alone():
    rows = [_row("free0", "delay-free", 0.0, 100.0), _row("run0", "deadline", 5.0, 95.0),
            _row("free1", "delay-free", 0.0, 50.0, seed=1), _row("run1", "deadline", 5.0, 45.0, seed=1)]
    _compare(rows)
    ratio = {r["run"]: r["throughput_vs_delay_free"] for r in rows}
    assert ratio["run0"] == pytest.approx(0.95) and ratio["run1"] == pytest.approx(0.9)


def test_each_run_is_compared_with_the_delay_free_runs_closest_around_it():
    # a delay-free run after every delay model's runs: the machine slowed, then recovered; each
    # run is read against the two delay-free runs that bracket it, not the seed's first and last
    rows = [_row("free0", "delay-free", 0.0, 100.0), _row("a", "deadline", 5.0, 72.0),
            _row("free1", "delay-free", 10.0, 60.0), _row("b", "deadline", 15.0, 80.0),
            _row("free2", "delay-free", 20.0, 100.0)]
    _compare(rows)
    ratio = {r["run"]: r["throughput_vs_delay_free"] for r in rows}
    assert ratio["a"] == pytest.approx(72.0 / 80.0) and ratio["b"] == pytest.approx(1.0)


def test_the_tables_describe_the_runs_they_read_not_the_flags_of_the_call():
    # --from recomputes the tables of finished runs: their steps, batch and micro-batches come
    # from the runs' own configs; runs of two setups in one table are refused
    rows = [_row("free0", "delay-free", 0.0, 100.0, micro=16), _row("run0", "deadline", 5.0, 95.0, micro=16),
            _row("free1", "delay-free", 0.0, 90.0, seed=1, micro=16)]
    assert _setup(rows) == {"seeds": 2, "steps": 12, "batch_size": 64, "micro_batches": 16}
    with pytest.raises(ValueError, match=r"straggler.micro_batches \(8, 16\)"):
        _setup([*rows, _row("run1", "deadline", 5.0, 80.0, seed=1, micro=8)])


def test_the_cores_busy_and_the_cpu_per_sample_are_read_against_the_delay_free_runs_around_each_run():
    # throughput = cores busy / CPU time per sample: a run that left 4 % of the cores idle on a
    # machine that got 10 % slower meanwhile shows both, apart; a run without a CPU trace has none
    rows = [_row("free0", "delay-free", 0.0, 100.0, busy=0.99, cpu_ms=16.0, compute_ms=15.0),
            _row("run", "deadline", 5.0, 82.0, busy=0.95, cpu_ms=17.6, compute_ms=15.3),
            _row("free1", "delay-free", 10.0, 90.0, busy=0.99, cpu_ms=19.2, compute_ms=18.0),
            _row("blind", "deadline", 5.0, 95.0, seed=1), _row("free2", "delay-free", 0.0, 100.0, seed=1)]
    _compare(rows)
    by = {r["run"]: r for r in rows}
    assert by["run"]["cores_busy_vs_delay_free"] == pytest.approx(0.95 / 0.99)
    assert by["run"]["cpu_per_sample_vs_delay_free"] == pytest.approx(1.0)
    assert by["run"]["compute_cpu_per_sample_vs_delay_free"] == pytest.approx(15.3 / 16.5)
    assert by["blind"]["cores_busy_vs_delay_free"] is None and by["blind"]["cpu_per_sample_vs_delay_free"] is None
    summary = {r["mode"]: r for r in _summary(rows)}
    assert summary["deadline"]["cores_busy"] == pytest.approx(0.95)  # the median of the runs that have one
    assert summary["deadline"]["cores_busy_vs_delay_free"] == pytest.approx(0.95 / 0.99)
    assert summary["deadline"]["cpu_outside_compute"] == pytest.approx(0.02)


@pytest.mark.parametrize("measured", [True, False])
def test_the_ranks_compute_cpu_and_the_share_outside_it_come_from_their_timeline(tmp_path: Path, measured: bool):
    # steps after the first: 2 ranks x 3 steps of 8 samples, 0.1 s of CPU each, 0.09 s in compute
    table = np.zeros((2, 4, len(FIELDS)))
    table[:, :, FIELDS.index("start_time_s")] = np.arange(4) + 100.0
    table[:, :, FIELDS.index("step_s")] = 1.0
    table[:, :, FIELDS.index("samples")] = 8
    table[:, :, FIELDS.index("cpu_s")] = [[5.0, 0.1, 0.1, 0.1]] * 2  # the first step's set-up does not count
    table[:, :, FIELDS.index("compute_cpu_s")] = [[1.0, 0.09, 0.09, 0.09]] * 2
    if not measured:  # a timeline of an earlier poise: no CPU fields
        table[:, :, FIELDS.index("cpu_s")] = table[:, :, FIELDS.index("compute_cpu_s")] = np.nan
    save_table(table, tmp_path / "timeline.npz")
    row = _cpu_row(tmp_path, table)
    if measured:
        assert row["compute_cpu_ms_per_sample"] == pytest.approx(1000 * 0.09 / 8)
        assert row["cpu_outside_compute"] == pytest.approx(0.1)
    else:
        assert row["compute_cpu_ms_per_sample"] is None and row["cpu_outside_compute"] is None
    assert row["cores_busy"] is None  # no CPU trace of the machine in this job's directory


def test_cpu_use_reads_the_samples_inside_the_window(tmp_path: Path):
    trace = tmp_path / "cpu.txt"
    trace.write_text("10.0 100.0 200.0\n11.0 101.5 202.0\n12.0 102.0 204.0\n13.0 104.0 206.0\n")
    busy, seconds = cpu_use(trace, 10.5, 13.0)  # samples at 11, 12, 13: 2.5 busy of 4 core-seconds
    assert (busy, seconds) == (pytest.approx(0.625), pytest.approx(2.5))
    assert cpu_use(trace, 12.5, 13.5) is None  # one sample: no interval
    assert cpu_use(tmp_path / "missing.txt", 0.0, 1.0) is None
    for bad in ("10.0 100.0\n11.0 101.0\n", "10.0 100.0 200.0\n11.0 99.0 202.0\n", "a b c\n"):
        trace.write_text(bad)
        with pytest.raises(ValueError, match="is not a CPU trace"):
            cpu_use(trace, 0.0, 20.0)


@pytest.mark.skipif(not PROC_STAT.exists(), reason="/proc/stat is Linux's")
def test_cpu_trace_sees_a_busy_loop(tmp_path: Path):
    trace = tmp_path / "job" / "cpu.txt"
    start = time.time()
    with cpu_trace(trace, period_s=0.01):
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    busy, seconds = cpu_use(trace, start, time.time())
    # this loop keeps one core busy: at least part of one of the machine's cores, never more than all
    assert 0.0 < busy <= 1.0 and seconds > 0.2
