"""Balance ``auto``'s split as pure functions: DDP's steps kept, each split into ranges of
similar lengths by predicted time (poise/balance/sharding.py, "Mixed steps")."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.balance import balance, make_sampler
from poise.balance.costs import AttentionCost, padded_cost
from poise.balance.sharding import plan_fixed_steps, split_sorted

# a long-tailed length distribution like source files', capped at 1024
LENGTHS = np.minimum(np.random.default_rng(0).lognormal(5.0, 1.1, size=1200).astype(int) + 2, 1024)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(1, 4), alpha=st.sampled_from([0.0, 1e-3]),
       speeds=st.lists(st.floats(0.05, 1.0), min_size=4, max_size=4), seed=st.integers(0, 5))
def test_every_sample_of_a_step_goes_to_one_rank_in_ranges_sorted_by_length(n, world, alpha, speeds, seed):
    step = np.random.default_rng(seed).choice(len(LENGTHS), size=n, replace=False)
    split = split_sorted(step, LENGTHS, AttentionCost(alpha), np.array(speeds[:world]))
    assert sorted(np.concatenate(split.batches).tolist()) == sorted(step.tolist())
    if n >= world:
        assert all(len(b) >= 1 for b in split.batches)
    # contiguous ranges of the length order: no two ranks' length intervals overlap beyond a tie
    spans = sorted((int(LENGTHS[b].min()), int(LENGTHS[b].max())) for b in split.batches if len(b))
    assert all(lo_next >= hi for (_, hi), (lo_next, _) in itertools.pairwise(spans))


@pytest.mark.parametrize("speeds", [(1.0, 1.0), (1.0, 0.5), (0.3, 1.0)])
def test_two_ranks_get_the_best_contiguous_cut(speeds):
    """Against every cut point in both rank orders (brute force): the bisection finds the least
    slowest-rank time that two contiguous ranges allow."""
    cost, speeds = AttentionCost(1e-3), np.array(speeds)
    for seed in range(20):
        step = np.random.default_rng(seed).choice(len(LENGTHS), size=32, replace=False)
        ranked = step[np.lexsort((step, -LENGTHS[step]))]
        best = min(max(padded_cost(cost, LENGTHS[ranked[:k]]) / speeds[a],
                       padded_cost(cost, LENGTHS[ranked[k:]]) / speeds[1 - a])
                   for k in range(1, 32) for a in (0, 1))
        got = split_sorted(step, LENGTHS, cost, speeds).predicted_s.max()
        assert got == pytest.approx(best, rel=1e-9)


def test_a_slower_rank_is_given_less_predicted_work():
    step = np.random.default_rng(3).choice(len(LENGTHS), size=48, replace=False)
    cost = AttentionCost(1e-3)
    split = split_sorted(step, LENGTHS, cost, np.array([1.0, 0.5]))
    work = [padded_cost(cost, LENGTHS[b]) for b in split.batches]
    assert work[1] < 0.75 * work[0]
    assert balance(split.predicted_s) > 0.85


@pytest.mark.parametrize("budget", [{"batch_size": 8}, {"batch_tokens": 4096}])
@pytest.mark.parametrize("world", [2, 3])
def test_auto_steps_hold_exactly_ddps_samples_whatever_the_speeds(budget, world):
    static = make_sampler("static", LENGTHS, rank=0, world_size=world, seed=4, **budget)
    auto = make_sampler("auto", LENGTHS, rank=0, world_size=world, seed=4, cost_fn=AttentionCost(1e-3), **budget)
    assert len(auto) == len(static) and auto.steps_in_epochs(2) == static.steps_in_epochs(2)
    auto.set_speeds(np.linspace(1.0, 0.4, world))
    for j in range(len(static)):
        if j == len(static) // 2:
            auto.set_speeds(np.linspace(0.4, 1.0, world))  # a re-plan mid-epoch moves who, never what
        assert sorted(np.concatenate(auto.global_batches(j)).tolist()) == \
            sorted(np.concatenate(static.global_batches(j)).tolist())


def _padding(sampler) -> float:
    padded = real = 0
    for j in range(len(sampler)):
        for b in sampler.global_batches(j):
            padded += len(b) * int(LENGTHS[b].max())
            real += int(LENGTHS[b].sum())
    return padded / real - 1.0


def test_auto_pads_less_than_ddp_and_keeps_each_step_a_random_mix():
    """Padding is per rank, so ranges of similar lengths remove most of it; the steps stay DDP's
    random draws: consecutive steps' mean lengths are uncorrelated (Spearman near 0), which
    length bucketing is not."""
    static = make_sampler("static", LENGTHS, rank=0, world_size=2, seed=1, batch_size=16)
    auto = make_sampler("auto", LENGTHS, rank=0, world_size=2, seed=1, batch_size=16)
    bucketed = make_sampler("cost", LENGTHS, rank=0, world_size=2, seed=1, batch_size=16)
    assert _padding(auto) < 0.6 * _padding(static)

    def lag_one_rank_correlation(sampler, lengths) -> float:
        means = np.array([lengths[np.concatenate(sampler.global_batches(j))].mean() for j in range(len(sampler))])
        ranks = np.argsort(np.argsort(means))
        return float(np.corrcoef(ranks[:-1], ranks[1:])[0, 1])

    many = np.random.default_rng(5).choice(LENGTHS, size=8000)  # ~250 steps: the correlation's error ~0.06
    assert abs(lag_one_rank_correlation(make_sampler("auto", many, rank=0, world_size=2, seed=1, batch_size=16),
                                        many)) < 0.2
    spread = [np.ptp(LENGTHS[np.concatenate(s.global_batches(j))]) for s in (auto, bucketed) for j in range(5)]
    assert np.median(spread[:5]) > 4 * np.median(spread[5:])  # a mixed step spans the distribution; a bucket does not


def test_auto_resumes_on_another_number_of_ranks_with_every_sample_once():
    auto = make_sampler("auto", LENGTHS, rank=0, world_size=2, seed=2, batch_size=8)
    done = [i for j in range(7) for b in auto.global_batches(j) for i in b.tolist()]
    auto.position = 7
    state = auto.state_dict()
    resumed = make_sampler("auto", LENGTHS, rank=1, world_size=3, seed=2, batch_size=8)
    resumed.load_state_dict(state)
    rest = [i for j in range(len(resumed)) for b in resumed.global_batches(j) for i in b.tolist()]
    assert sorted(done + rest) == sorted(np.concatenate(
        [np.concatenate(s) for s in (make_sampler("static", LENGTHS, rank=0, world_size=2, seed=2, batch_size=8)
                                     .global_batches(j) for j in range(len(auto)))]).tolist())


def test_fixed_steps_refuse_an_empty_step():
    with pytest.raises(ValueError, match="at least one sample"):
        plan_fixed_steps([np.array([1, 2]), np.array([], dtype=np.int64)])


def test_auto_with_a_cost_budget_draws_random_steps_of_it():
    cost = AttentionCost(1e-3)
    auto = make_sampler("auto", LENGTHS, rank=0, world_size=2, seed=0, cost_fn=cost, batch_cost=40_000.0)
    seen = sorted(i for j in range(len(auto)) for b in auto.global_batches(j) for i in b.tolist())
    assert seen == list(range(len(LENGTHS)))


def test_an_auto_run_is_replayed_with_its_own_re_plans(tmp_path):
    """The pin a decision names: balance.replay with the run's report.json gives the same
    shares at the same steps (and so the same split of DDP's steps), without measuring."""
    import json

    from poise.balance.replay import ReplayedPartitioner, load_replans
    from poise.config import BalanceConfig

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"replans": [{"step": 2, "shares": [0.5, 0.5], "decision": "wait"},
                                              {"step": 3, "shares": [0.7, 0.3], "decision": "jump"},
                                              {"step": 6, "shares": [0.5, 0.5], "decision": "revert"}]}))
    assert BalanceConfig(strategy="auto", replay=str(report)).replay
    with pytest.raises(ValueError, match=r"needs balance\.strategy=auto or dynamic"):
        BalanceConfig(strategy="cost", replay=str(report))
    sampler = make_sampler("auto", LENGTHS, rank=0, world_size=2, batch_size=8)
    replay = ReplayedPartitioner(sampler, load_replans(report, 2))
    shares = []
    for step in range(1, 8):
        replay.after_step(step, step)
        shares.append(round(float(sampler.speeds[0] / sampler.speeds.sum()), 3))
    assert shares == [0.5, 0.5, 0.7, 0.7, 0.7, 0.5, 0.5]
