"""The sleep method of emulated slow ranks (``poise/runtime/slowdown.py``)."""

from __future__ import annotations

import time

from poise.runtime.slowdown import Slowdown


def test_sleep_slowdown_stretches_compute_by_one_over_speed():
    slow = Slowdown(speed=0.5, method="sleep")
    slow.mark_s = time.perf_counter()
    time.sleep(0.02)  # 20 ms of "compute" ...
    began = time.perf_counter()
    slow.stretch()  # ... is followed by at least 20 ms more (speed 0.5: twice as long)
    assert time.perf_counter() - began >= 0.02


def test_a_backward_before_the_first_mark_is_not_slowed():
    # the resume path's throw-away backward runs before any training step marked the time:
    # it used to sleep (1/speed - 1) x the whole perf_counter() clock, i.e. hours
    slow = Slowdown(speed=0.2, method="sleep")
    began = time.perf_counter()
    slow.stretch()
    assert time.perf_counter() - began < 1.0
    assert slow.mark_s is not None  # later buckets of that backward are measured from here
