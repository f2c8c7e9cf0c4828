"""Cost functions, the α fit, speed estimates and the share limiter."""

import numpy as np
import pytest

from poise.balance.costs import AttentionCost, fit_alpha, measured_speeds
from poise.balance.rebalance import DynamicPartitioner, Replan
from poise.balance.sampler import BalancedBatchSampler
from poise.balance.speeds import (
    RECENT_STEPS,
    SpeedEstimate,
    choose_shares,
    estimate_speeds,
    next_shares,
    speed_scatter,
)


def test_attention_cost():
    assert AttentionCost(0.5)(np.array([2.0, 4.0])).tolist() == [4.0, 12.0]


def _noisy_steps(seed: int, size: int, shortest: tuple[int, int], alpha: float, noise: float):
    """Steps of n samples padded to ``longest`` (n from ``shortest[0]``, longest from
    ``shortest[1]``, both random), their (n·L, n·L²) terms and times 2e-6·cost with relative noise."""
    rng = np.random.default_rng(seed)
    n = rng.integers(shortest[0], 16, size=size)
    longest = rng.integers(shortest[1], 1024, size=size)
    lin, quad = n * longest, n * longest**2.0
    return lin, quad, 2e-6 * (lin + alpha * quad) * rng.normal(1.0, noise, size=size)


def test_fit_alpha_recovers_a_known_alpha_from_noisy_times():
    lin, quad, times = _noisy_steps(0, 60, (1, 16), 1.5e-3, 0.03)
    assert fit_alpha(lin, quad, times) == pytest.approx(1.5e-3, rel=0.15)


def test_fit_alpha_declines_when_data_cannot_tell():
    assert fit_alpha(np.ones(3), np.ones(3), np.ones(3)) is None  # too few steps
    assert fit_alpha(np.zeros(10), np.ones(10), np.ones(10)) is None  # no linear term
    lin = np.arange(1.0, 11.0)
    assert fit_alpha(lin, lin**2, 5.0 - 0.01 * lin**2) is None  # negative quadratic term


def test_fit_alpha_fits_relative_error_so_a_few_long_steps_do_not_decide_alpha():
    lin, quad, times = _noisy_steps(1, 40, (4, 64), 1e-3, 0.02)
    # two steps of many short samples, 4x slower than the model says (cache misses on big
    # batches): in seconds they are the largest residuals, in relative error two of 42
    lin, quad = np.append(lin, [40_000.0, 40_000.0]), np.append(quad, [4e6, 4e6])
    times = np.append(times, 4 * 2e-6 * (40_000 + 1e-3 * 4e6) * np.ones(2))
    assert fit_alpha(lin, quad, times) == pytest.approx(1e-3, rel=0.3)


def test_fit_alpha_declines_nonpositive_times():
    lin = np.arange(1.0, 11.0)
    assert fit_alpha(lin, lin**2, np.zeros(10)) is None


def test_measured_speeds_is_the_geometric_mean_of_the_steps_speeds():
    speeds = measured_speeds(np.array([[100.0, 100.0], [100.0, 100.0]]), np.array([[1.0, 1.0], [2.0, 2.0]]))
    assert speeds == pytest.approx([100.0, 50.0])
    # one short step and one long one: the geometric mean (200), not Σ cost / Σ time (160)
    assert measured_speeds(np.array([[100.0, 100.0]]), np.array([[1.0, 0.25]])) == pytest.approx([200.0])
    # a step without a measured time is left out
    assert measured_speeds(np.array([[100.0, 100.0]]), np.array([[0.5, 0.0]])) == pytest.approx([200.0])
    with pytest.raises(ValueError, match="cannot estimate speeds"):
        measured_speeds(np.ones((2, 2)), np.zeros((2, 2)))


def test_speed_scatter_is_smaller_with_the_right_alpha():
    rng = np.random.default_rng(2)
    n = rng.integers(4, 16, size=(2, 30)).astype(float)
    longest = rng.integers(64, 1024, size=(2, 30)).astype(float)
    lin, quad = n * longest, n * longest**2
    true = np.array([3e-4, 1e-3])
    seconds = 1e-6 * (lin + true[:, None] * quad) * rng.normal(1.0, 0.01, size=(2, 30))
    steps = np.stack([lin, quad, seconds], axis=2)
    assert speed_scatter(steps, true) < 0.02
    assert speed_scatter(steps, np.full(2, 6e-4)) > 2 * speed_scatter(steps, true)


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


@pytest.mark.parametrize("since", [3, 4])
def test_a_change_seen_a_few_steps_after_it_keeps_only_the_steps_since(since):
    """Re-planned after every step, a change of speed is seen 3 steps after it: only those
    steps describe the rank now (the ones before it would pull its speed back)."""
    rng = np.random.default_rng(1)
    cost = np.full((2, 20), 100.0)
    seconds = 1.0 + 0.02 * rng.standard_normal((2, 20))
    seconds[1, -since:] *= 2.0
    changed = estimate_speeds(cost, seconds)
    assert changed.keep_steps == since and changed.speeds[1] == pytest.approx(50, rel=0.03)


def test_a_rank_that_computed_nothing_in_the_recent_steps_keeps_the_whole_window():
    """A deadline moved all of slow rank 1's work to rank 0 in the last steps: rank 0's speed
    relative to the others jumps there, but rank 1 has no speed in them; narrowing the window
    to them stopped a dynamic-balancing job with 'cannot estimate speeds'."""
    rng = np.random.default_rng(0)
    cost = np.full((2, 20), 100.0)
    seconds = 1.0 + 0.02 * rng.standard_normal((2, 20))
    seconds[1] *= 6.0
    cost[1, -RECENT_STEPS:] = 0.0
    seconds[1, -RECENT_STEPS:] = 0.0
    estimate = estimate_speeds(cost, seconds)
    assert estimate.keep_steps == 20 and estimate.speeds[1] == pytest.approx(100 / 6, rel=0.03)


def test_speed_errors_and_changes_are_judged_relative_to_the_other_ranks():
    rng = np.random.default_rng(0)
    cost = np.full((2, 20), 100.0)
    machine = np.exp(0.2 * rng.standard_normal(20))  # what every rank's step shares: 20 % scatter
    seconds = machine * (1.0 + 0.01 * rng.standard_normal((2, 20)))
    steady = estimate_speeds(cost, seconds)
    assert np.all(steady.rel_error < 0.005)  # the shared scatter cancels: it cannot move shares
    seconds[:, -RECENT_STEPS:] *= 2.0  # the whole machine slowed down: the shares stay right
    assert estimate_speeds(cost, seconds).keep_steps == 20


def test_choose_shares_holds_within_noise_jumps_when_confident_and_damps_otherwise():
    current = np.array([0.5, 0.5])
    near = SpeedEstimate(np.array([1.01, 1.0]), np.array([0.02, 0.02]), 20)
    assert choose_shares(current, near, 0.15, 0.05)[1] == "hold"
    sure = SpeedEstimate(np.array([2.0, 1.0]), np.array([0.01, 0.01]), 20)
    shares, decision = choose_shares(current, sure, 0.15, 0.05)
    assert decision == "jump" and shares == pytest.approx([2 / 3, 1 / 3])
    unsure = SpeedEstimate(np.array([2.0, 1.0]), np.array([0.15, 0.15]), 20)  # its band's edge: 0.433
    shares, decision = choose_shares(current, unsure, 0.15, 0.05)
    assert decision == "damped" and shares[0] == pytest.approx(0.5 * 1.15)


def test_an_almost_confident_estimate_moves_to_the_near_edge_of_its_band() -> None:
    # run c's first re-plan after the cold start: rank 1 at half speed, known to 7 %
    current, target = np.array([0.5, 0.5]), np.array([2 / 3, 1 / 3])
    shares, decision = choose_shares(current, SpeedEstimate(np.array([2.0, 1.0]), np.array([0.07, 0.07]), 9),
                                     0.15, 0.05)
    assert decision == "edge"
    assert shares[1] == pytest.approx(target[1] * 1.14)  # two errors short of the target: not past it
    assert abs(shares[1] / target[1] - 1) < abs(0.5 * 0.85 / target[1] - 1)  # closer than the damping
    # from 15 % off, the damping reaches the target itself: it is taken
    near = np.array([1 - target[1] * 1.15, target[1] * 1.15])
    shares, decision = choose_shares(near, SpeedEstimate(np.array([2.0, 1.0]), np.array([0.06, 0.06]), 9),
                                     0.15, 0.05)
    assert decision == "damped" and shares == pytest.approx(target)


def test_two_steps_that_happen_to_agree_are_not_confident_but_a_half_speed_rank_still_moves() -> None:
    cost = np.full((2, 2), 1000.0)
    # equal ranks whose first 2 measured steps both had rank 1 slower (a warm-up, a busy core):
    # their spread is small, but 1 degree of freedom says little (Student's t: 12.7 / 1.96 wider)
    seconds = np.array([[0.100, 0.100], [0.155, 0.170]])
    warm_up = estimate_speeds(cost, seconds)
    relative = np.log(seconds[1] / seconds[0])  # rank 0's log speed against the other rank's
    unwidened = np.std(relative, ddof=1) / np.sqrt(2)
    assert unwidened < 0.05 < 0.25 < warm_up.rel_error[0]  # was read as known to 5 %: shares 0.62 0.38
    shares, decision = choose_shares(np.array([0.5, 0.5]), warm_up, 0.15, 0.05)
    assert decision == "hold" and shares == pytest.approx([0.5, 0.5])
    # a rank at half speed over 4 steps with 5 % noise is still moved most of the way at once
    noise = 1 + 0.05 * np.array([[0.3, -1.0, 0.8, -0.2], [-0.6, 0.9, -0.1, 0.4]])
    half = estimate_speeds(np.full((2, 4), 1000.0), np.array([[0.1] * 4, [0.2] * 4]) * noise)
    shares, decision = choose_shares(np.array([0.5, 0.5]), half, 0.15, 0.05)
    assert decision in ("jump", "edge") and shares[0] > 0.6


def _fed_partitioner(seconds_per_cost: list[float]) -> tuple[DynamicPartitioner, list]:
    """One rank's partitioner fed one step per entry (its compute seconds per cost unit),
    re-planning when due; returns it and its re-plans."""
    lengths = np.random.default_rng(0).integers(16, 512, size=4000)
    sampler = BalancedBatchSampler(lengths, rank=0, world_size=1, batch_cost=8_000, cost_fn=AttentionCost(1e-3))
    part = DynamicPartitioner(sampler, cold_start_steps=5, window_steps=20, replan_every_steps=5)
    rng = np.random.default_rng(1)
    sampler.set_epoch(0)
    for done, rate in enumerate(seconds_per_cost, start=1):
        batch = lengths[sampler.global_batches(done - 1)[0]]
        part.observe(batch, rate * len(batch) * AttentionCost(1e-3)(batch).max() * rng.normal(1.0, 0.01))
        if part.due(done):
            part.replan(done)
    return part, part.history


class _Scripted(DynamicPartitioner):
    """A one-rank re-planner whose re-plans return scripted decisions (the cadence under test)."""

    def __init__(self, decisions: dict[int, str], **kwargs) -> None:
        lengths = np.random.default_rng(0).integers(16, 512, size=400)
        super().__init__(BalancedBatchSampler(lengths, rank=0, world_size=1, batch_cost=8_000), **kwargs)
        self.decisions, self.at = decisions, []

    def replan(self, step: int) -> Replan:
        self.at.append(step)
        return Replan(step, [], [1.0], None, decision=self.decisions.get(step, "hold"))


def test_auto_replans_less_often_while_the_shares_hold_and_every_step_again_after_a_move():
    part = _Scripted({1: "wait", 2: "wait", 13: "jump", 14: "trial", 15: "trial", 16: "confirm"},
                     replan_every_steps=1, max_replan_every_steps=4)
    for step in range(1, 31):
        part.after_step(step, step)
    # every step in the cold start; holds double the interval to 4; a move and its trial: every step
    assert part.at == [1, 2, 3, 5, 9, 13, 14, 15, 16, 17, 19, 23, 27]
    saved = part.state_dict()
    assert (saved["replan_every"], saved["next_replan"]) == (4, 31)
    again = _Scripted({}, replan_every_steps=1, max_replan_every_steps=4)
    again.load_state_dict(saved)  # a resumed run keeps the cadence: the next re-plan after step 30
    for step in range(31, 40):
        again.after_step(step, step)
    assert again.at == [31, 35, 39]
    fixed = _Scripted({}, replan_every_steps=5, cold_start_steps=5)  # dynamic: the cadence it was given
    for step in range(1, 21):
        fixed.after_step(step, step)
    assert fixed.at == [5, 10, 15, 20]


def test_alpha_is_fitted_from_the_history_and_speeds_from_the_last_window():
    part, replans = _fed_partitioner([1e-6] * 61)
    assert len(part.window) == 60  # every step after the first is kept for α (up to HISTORY_STEPS)
    assert replans[-1].window_steps == 20  # the speed: the last window_steps of them
    assert replans[-1].speeds[0] == pytest.approx(1e6, rel=0.02)
    assert replans[-1].alpha == pytest.approx(1e-3, rel=0.1)


def test_a_change_every_rank_shares_keeps_the_history():
    # a lone rank (or all ranks alike) slowing down cannot move the shares: α keeps its steps
    part, replans = _fed_partitioner([1e-6] * 45 + [2e-6] * 5)
    assert replans[-1].window_steps == 20 and len(part.window) == 49


