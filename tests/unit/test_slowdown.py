"""The sleep method of emulated slow ranks (``poise/runtime/slowdown.py``)."""

from __future__ import annotations

import pytest

from poise.runtime import slowdown
from poise.runtime.slowdown import Slowdown


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
    slow.mark_s = slowdown.time.perf_counter()  # 100.00
    slow.stretch()  # 0.02 s of compute since the mark: speed 0.5 sleeps as long again
    assert sleeps == [pytest.approx(0.02)]


def test_a_backward_before_the_first_mark_is_not_slowed(sleeps):
    # the resume path's throw-away backward runs before any training step marked the time:
    # it used to sleep (1/speed - 1) x the whole perf_counter() clock (here 4 x 100 s)
    slow = Slowdown(speed=0.2, method="sleep")
    slow.stretch()
    assert sleeps == []
    assert slow.mark_s == pytest.approx(100.0)  # later buckets of that backward count from here
