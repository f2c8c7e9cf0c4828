"""Cost functions, the α fit, speed estimates and the share limiter."""

import numpy as np
import pytest

from poise.balance.costs import AttentionCost, fit_alpha, measured_speeds
from poise.balance.rebalance import next_shares


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
