"""Time to accuracy from an eval curve (``poise bench network``): the pure interpolation."""

from __future__ import annotations

import pytest

from poise.bench.network import steps_to_target, time_to_target

CURVE = [{"step": 10, "train_s": 5.0, "loss": 3.0}, {"step": 20, "train_s": 10.0, "loss": 2.0},
         {"step": 30, "train_s": 15.0, "loss": 1.5}]


def test_the_crossing_is_interpolated_between_the_evaluations_around_it():
    assert time_to_target(CURVE, 2.5) == pytest.approx(7.5)
    assert steps_to_target(CURVE, 1.75) == pytest.approx(25.0)


def test_a_target_met_at_an_evaluation_or_at_the_first_is_that_time():
    assert time_to_target(CURVE, 2.0) == 10.0
    assert time_to_target(CURVE, 4.0) == 5.0


def test_a_target_never_reached_is_none():
    assert time_to_target(CURVE, 1.0) is None and time_to_target([], 1.0) is None
