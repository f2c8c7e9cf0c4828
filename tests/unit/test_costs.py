"""Cost functions, the α fit, speed estimates and the share limiter."""

import numpy as np
import pytest

from poise.balance.costs import AttentionCost, fit_alpha, measured_speeds
from poise.balance.rebalance import RECENT_STEPS, SpeedEstimate, choose_shares, estimate_speeds, next_shares


def test_attention_cost():
    assert AttentionCost(0.5)(np.array([2.0, 4.0])).tolist() == [4.0, 12.0]


def test_fit_alpha_recovers_a_known_alpha_from_noisy_times():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 16, size=60)
    longest = rng.integers(16, 1024, size=60)
    lin, quad = n * longest, n * longest**2.0
    times = 2e-6 * (lin + 1.5e-3 * quad) * rng.normal(1.0, 0.03, size=60)
    assert fit_alpha(lin, quad, times) == pytest.approx(1.5e-3, rel=0.15)


def test_fit_alpha_declines_when_data_cannot_tell():
    assert fit_alpha(np.ones(3), np.ones(3), np.ones(3)) is None  # too few steps
    assert fit_alpha(np.zeros(10), np.ones(10), np.ones(10)) is None  # no linear term
    lin = np.arange(1.0, 11.0)
    assert fit_alpha(lin, lin**2, 5.0 - 0.01 * lin**2) is None  # negative quadratic term


def test_measured_speeds():
    speeds = measured_speeds(np.array([[100.0, 100.0], [100.0, 100.0]]), np.array([[1.0, 1.0], [2.0, 2.0]]))
    assert speeds.tolist() == [100.0, 50.0]
    with pytest.raises(ValueError):
        measured_speeds(np.ones((2, 2)), np.zeros((2, 2)))


def test_next_shares_moves_at_most_the_limit_and_converges():
    shares = np.array([0.5, 0.5])
    history = []
    for _ in range(10):
        new = next_shares(shares, np.array([2.0, 1.0]), 0.15)
        assert np.all(np.abs(new / shares - 1) <= 0.15 + 1e-9)
        assert new.sum() == pytest.approx(1.0)
        shares = new
        history.append(shares[0])
    assert shares[0] == pytest.approx(2 / 3, abs=1e-6)
    assert history == sorted(history)  # monotone: no oscillation


def test_next_shares_many_ranks_sum_to_one_within_limits():
    current = np.array([0.1, 0.2, 0.3, 0.4])
    new = next_shares(current, np.array([4.0, 1.0, 1.0, 1.0]), 0.15)
    assert new.sum() == pytest.approx(1.0)
    assert np.all(np.abs(new / current - 1) <= 0.15 + 1e-9)


def test_estimate_speeds_drops_the_steps_before_a_change_of_speed():
    rng = np.random.default_rng(0)
    cost = np.full((2, 20), 100.0)
    seconds = 1.0 + 0.02 * rng.standard_normal((2, 20))
    steady = estimate_speeds(cost, seconds)
    assert steady.keep_steps == 20 and steady.speeds == pytest.approx([100, 100], rel=0.02)
    assert np.all(steady.rel_error < 0.01)
    seconds[1, -RECENT_STEPS:] *= 2.0  # rank 1 got twice as slow in the last steps
    changed = estimate_speeds(cost, seconds)
    assert changed.keep_steps == RECENT_STEPS
    assert changed.speeds[1] == pytest.approx(50, rel=0.03)


def test_choose_shares_holds_within_noise_jumps_when_confident_and_damps_otherwise():
    current = np.array([0.5, 0.5])
    near = SpeedEstimate(np.array([1.01, 1.0]), np.array([0.02, 0.02]), 20)
    assert choose_shares(current, near, 0.15, 0.05)[1] == "hold"
    sure = SpeedEstimate(np.array([2.0, 1.0]), np.array([0.01, 0.01]), 20)
    shares, decision = choose_shares(current, sure, 0.15, 0.05)
    assert decision == "jump" and shares == pytest.approx([2 / 3, 1 / 3])
    unsure = SpeedEstimate(np.array([2.0, 1.0]), np.array([0.1, 0.1]), 20)
    shares, decision = choose_shares(current, unsure, 0.15, 0.05)
    assert decision == "damped" and shares[0] == pytest.approx(0.5 * 1.15)
