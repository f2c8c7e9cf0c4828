"""The sleep method of emulated slow ranks (``poise/emulate/speed.py``)."""

from __future__ import annotations

import pytest

from poise.emulate import speed as slowdown
from poise.emulate.speed import Slowdown


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds each time.sleep call of the slowdown asked for (none is slept), on a fake
    perf_counter clock that reads 100 s since boot, then +0.02 s on every call."""
    asked: list[float] = []
    clock = iter([100.0 + 0.02 * i for i in range(100)])
    monkeypatch.setattr(slowdown.time, "sleep", asked.append)
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: next(clock))
    return asked


def test_sleep_slowdown_stretches_compute_by_one_over_speed(sleeps):
    slow = Slowdown(speed=0.5, method="sleep")
    slow.begin_step(0)
    slow.mark_s = slowdown.time.perf_counter()  # 100.00
    slow.stretch()  # 0.02 s of compute since the mark: speed 0.5 sleeps as long again
    assert sleeps == [pytest.approx(0.02)]


def test_a_backward_before_the_first_mark_is_not_slowed(sleeps):
    # the resume path's throw-away backward runs before any training step marked the time:
    # it used to sleep (1/speed - 1) x the whole perf_counter() clock (here 4 x 100 s)
    slow = Slowdown(speed=0.2, method="sleep")
    slow.begin_step(3)
    slow.mark_s = None
    slow.stretch()
    assert sleeps == []
    assert slow.mark_s == pytest.approx(100.0)  # later buckets of that backward count from here


def test_a_rank_slowed_from_a_step_on_runs_at_full_speed_before_it(sleeps):
    slow = Slowdown(speed=0.5, method="sleep", from_step=80)
    for step, expect in ((79, []), (80, [pytest.approx(0.02)])):
        slow.begin_step(step)
        slow.mark_s = slowdown.time.perf_counter()
        slow.stretch()
        assert sleeps == expect


def test_speed_noise_stretches_every_step_by_a_seeded_exponential(sleeps):
    noisy = Slowdown(noise=0.3, seed=7)
    extras = []
    for step in range(400):
        noisy.begin_step(step)
        extras.append(noisy._extra)
    again = Slowdown(noise=0.3, seed=7)
    again.begin_step(5)
    assert again._extra == extras[5]  # the same draw for the same seed and step, on every attempt
    assert min(extras) >= 0 and abs(sum(extras) / len(extras) - 0.3) < 0.05  # mean inflation 30 %


def test_a_rank_slowed_for_a_span_of_steps_recovers_at_its_end(sleeps):
    slow = Slowdown(speed=0.5, method="sleep", from_step=80, until_step=160)
    for step in (79, 80, 159, 160):
        slow.begin_step(step)
        slow.mark_s = slowdown.time.perf_counter()
        slow.stretch()
    assert sleeps == [pytest.approx(0.02)] * 2  # slowed at 80 and 159 only


def test_rank_speed_with_a_start_step_parses():
    from poise.config import EmulateConfig

    assert EmulateConfig(rank_speed="1:0.5@80,0:0.9").rank_speeds() == {1: (0.5, 80, None), 0: (0.9, 0, None)}
    assert EmulateConfig(rank_speed="1:0.5@80-160").rank_speeds() == {1: (0.5, 80, 160)}
    for bad in ("1:0.5@80-80", "1:0.5@80-x", "1:0.5@-3"):
        with pytest.raises(ValueError, match="RANK:SPEED@STEP-END"):
            EmulateConfig(rank_speed=bad)
    with pytest.raises(ValueError, match=r"give RANK:SPEED, RANK:SPEED@STEP"):
        EmulateConfig(rank_speed="1:0.5@x")


def test_by_cpu_stretches_the_cpu_seconds_not_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded model's forward waits in FSDP2's all-gathers: 1 s of wall time of which 0.1 s
    was CPU work sleeps 0.1 s at half speed, not 1 s."""
    asked: list[float] = []
    wall, cpu = iter([10.0, 11.0]), iter([5.0, 5.1, 5.1])
    monkeypatch.setattr(slowdown.time, "sleep", asked.append)
    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(slowdown.time, "process_time", lambda: next(cpu))
    slow = Slowdown(speed=0.5, method="sleep", by_cpu=True)
    slow.step_began(0)  # marks CPU 5.0
    slow.stretch()  # CPU 5.1: 0.1 s of compute, however long the wall clock ran
    assert asked == [pytest.approx(0.1)]
