"""Samplers: the static baseline and the balanced sampler's public API."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from poise.balance import as_cost_fn, make_sampler
from poise.balance.costs import AttentionCost
from poise.balance.epoch_sampler import EpochSampler
from poise.balance.sampler import BalancedBatchSampler
from poise.balance.static_schedule import StaticSchedule


def test_static_fixed_batches_cover_disjoint_equal_shares():
    s = StaticSchedule(np.arange(1, 101), rank=0, world_size=2, seed=3, batch_size=8)
    assert len(s) == 6
    seen = [i for step in range(len(s)) for b in s.global_batches(step) for i in b]
    assert len(seen) == len(set(seen)) == 96


def test_static_epochs_reshuffle_and_are_deterministic():
    a = StaticSchedule(np.ones(64), rank=0, world_size=2, seed=1, batch_size=4)
    b = StaticSchedule(np.ones(64), rank=1, world_size=2, seed=1, batch_size=4)
    assert [x.tolist() for x in a.global_batches(0)] == [x.tolist() for x in b.global_batches(0)]
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=8, max_size=300),
    world=st.integers(1, 4),
    budget=st.integers(64, 512),
    epoch=st.integers(0, 3),
)
def test_static_token_budget_respects_budget_and_aligns_step_counts(lengths, world, budget, epoch):
    lengths = np.array(lengths)
    try:
        s = StaticSchedule(lengths, rank=0, world_size=world, seed=0, batch_tokens=budget)
    except ValueError:
        assume(False)  # too few samples for one step per rank: rejected, as it should be
    s.set_epoch(epoch)
    seen: list[int] = []
    for step in range(len(s)):
        batches = s.global_batches(step)
        assert len(batches) == world
        for b in batches:
            assert lengths[b].max() * len(b) <= budget
            seen += b.tolist()
    assert len(seen) == len(set(seen))


def test_balanced_sampler_is_a_batch_sampler_with_resumable_state():
    lengths = np.random.default_rng(0).integers(10, 500, size=400)
    kwargs = dict(world_size=2, batch_cost=4000, cost_fn=AttentionCost(1e-3), seed=5)
    ranks = [BalancedBatchSampler(lengths, rank=r, **kwargs) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) > 0
    covered = sorted(i for s in ranks for batch in s for i in batch)
    assert covered == list(range(400))  # every sample exactly once per epoch, drop_last=False

    # stop mid-epoch with new speeds, resume in a fresh sampler: same remaining batches
    s = BalancedBatchSampler(lengths, rank=1, **kwargs)
    s.set_epoch(2)
    it = iter(s)
    for _ in range(3):
        next(it)
    s.set_speeds([1.0, 0.5])
    s.set_cost_fn(AttentionCost(2e-3))
    state = s.state_dict()
    rest = list(it)
    fresh = BalancedBatchSampler(lengths, rank=1, **kwargs)
    fresh.load_state_dict(state)
    assert list(fresh) == rest


def test_balanced_sampler_gives_the_slow_rank_less():
    lengths = np.full(1000, 100)
    s = BalancedBatchSampler(lengths, rank=0, world_size=2, batch_cost=3000, cost_fn=AttentionCost(0.0),
                             speeds=[1.0, 0.5])
    fast, slow = s.global_batches(0)
    assert len(fast) == 20 and len(slow) == 10


@pytest.mark.parametrize("speeds", [[1.0], [1.0, 0.0], [1.0, float("nan")]])
def test_balanced_sampler_rejects_bad_speeds(speeds):
    with pytest.raises(ValueError, match="speeds must be 2 positive numbers"):
        BalancedBatchSampler(np.ones(10), rank=0, world_size=2, batch_cost=4, speeds=speeds)


def test_cost_fn_may_be_a_function_of_one_length():
    """A user's ``lambda L: float(L)`` works like the vectorised ``lambda L: L``."""

    lengths = np.random.default_rng(0).integers(1, 300, size=200)
    scalar = BalancedBatchSampler(lengths, rank=0, world_size=2, batch_cost=1200, cost_fn=lambda n: float(n))
    vector = BalancedBatchSampler(lengths, rank=0, world_size=2, batch_cost=1200, cost_fn=lambda n: n * 1.0)
    assert len(scalar) == len(vector)
    assert all(np.array_equal(a, b) for step in range(len(scalar))
               for a, b in zip(scalar.global_batches(step), vector.global_batches(step), strict=True))
    branchy = BalancedBatchSampler(lengths, rank=0, world_size=2, batch_cost=1200,
                                   cost_fn=lambda n: 2.0 * n if n > 100 else float(n))  # only works on one number
    assert len(branchy) > len(scalar)


def test_a_cost_fn_that_is_not_a_cost_is_refused():

    with pytest.raises(ValueError, match="cost_fn must map a length to one finite cost >= 0"):
        as_cost_fn(lambda n: -1.0)
    with pytest.raises(ValueError, match="cost_fn must map"):
        as_cost_fn(lambda n: np.array([1.0, 2.0, 3.0]))


def test_set_epoch_after_loading_keeps_the_loaded_position():

    lengths = np.random.default_rng(0).integers(1, 300, size=200)
    for strategy, budget in (("static", {"batch_size": 4}), ("cost", {"batch_size": 4})):
        saved = make_sampler(strategy, lengths, rank=0, world_size=2, **budget)
        saved.set_epoch(1)
        for _ in zip(range(3), saved, strict=False):
            pass
        loaded = make_sampler(strategy, lengths, rank=0, world_size=2, **budget)
        loaded.load_state_dict(saved.state_dict())
        loaded.set_epoch(1)  # the usual epoch loop, right after loading
        assert (loaded.epoch, loaded.position) == (1, 3)
        loaded.set_epoch(1)  # a second time starts the epoch over, as always
        assert loaded.position == 0


def test_per_rank_cost_functions_are_kept_across_a_resume_and_checked_on_load():
    lengths = np.random.default_rng(1).integers(10, 1000, size=400)
    kwargs = dict(world_size=2, batch_cost=6000, cost_fn=AttentionCost(1e-3), seed=2)
    s = BalancedBatchSampler(lengths, rank=0, **kwargs)
    s.set_rank_cost_fns([AttentionCost(1e-4), AttentionCost(2e-3)])
    s.set_speeds([1.0, 0.6])
    it = iter(s)
    next(it)
    state = s.state_dict()
    rest = list(it)
    fresh = BalancedBatchSampler(lengths, rank=0, **kwargs)
    fresh.load_state_dict(state)
    assert list(fresh) == rest
    with pytest.raises(ValueError, match="rank cost functions: 3 given for 2 ranks"):
        s.set_rank_cost_fns([AttentionCost(0.0)] * 3)
    for bad in ([1e-3], [1e-3, float("nan")], [1e-3, -1.0], "x"):
        with pytest.raises(ValueError, match=r"rank_alphas=.* must be 2 finite alphas >= 0"):
            BalancedBatchSampler(lengths, rank=0, **kwargs).load_state_dict({**state, "rank_alphas": bad})


@pytest.mark.parametrize(("n", "world", "batch"), [(1437, 2, 32), (1000, 4, 7), (64, 2, 32), (65, 3, 5)])
def test_static_steps_in_epochs_computed_equals_planned(n: int, world: int, batch: int) -> None:
    """The computed count of a fixed batch size equals planning every epoch (the base class's way)."""
    sampler = StaticSchedule(np.ones(n, dtype=np.int64), rank=0, world_size=world, seed=3, batch_size=batch)
    assert sampler.steps_in_epochs(5) == EpochSampler.steps_in_epochs(sampler, 5)
