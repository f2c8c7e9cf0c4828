"""Resuming an epoch on another number of ranks trains on every sample of it exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from poise.balance.costs import AttentionCost
from poise.balance.sampler import BalancedBatchSampler
from poise.balance.static_schedule import StaticSchedule


def _static(world: int, **kw):
    lengths = np.random.default_rng(0).integers(16, 512, size=403)
    return lambda rank=0, w=world: StaticSchedule(lengths, rank=rank, world_size=w, seed=3, **kw)


def _balanced(world: int):
    lengths = np.random.default_rng(1).integers(16, 512, size=403)
    return lambda rank=0, w=world: BalancedBatchSampler(
        lengths, rank=rank, world_size=w, batch_cost=world * 8 * 300.0, cost_fn=AttentionCost(1e-3), seed=3,
        bucket_steps=5,
    )


def _trained(sampler, steps: int) -> list[np.ndarray]:
    out = []
    for i in range(sampler.position, sampler.position + steps):
        out.extend(sampler.global_batches(i))
        sampler.position = i + 1
    return out


@pytest.mark.parametrize("make", [_static(2, batch_size=8), _static(2, batch_tokens=2048), _balanced(2)],
                         ids=["static-batch", "static-tokens", "balanced"])
@pytest.mark.parametrize("new_world", [1, 3, 2])
def test_resumed_epoch_covers_the_uninterrupted_epoch_exactly_once(make, new_world):
    full = make()
    uninterrupted = np.sort(np.concatenate(_trained(full, len(full))))
    first = make()
    if isinstance(first, BalancedBatchSampler):
        first.set_speeds([1.0, 0.6])  # a re-plan happened before the failure
    done = _trained(first, 7)
    state = first.state_dict()
    second = make(rank=0, w=new_world)
    second.load_state_dict(state)
    rest = _trained(second, len(second) - second.position)
    got = np.concatenate(done + rest)
    assert len(np.unique(got)) == len(got), "a sample was trained on twice"
    if isinstance(first, StaticSchedule) and new_world == 2:
        np.testing.assert_array_equal(np.sort(got), uninterrupted)  # same world: the very same steps
    else:
        # the epoch's set: what the interrupted plan still owed, all of it, once
        np.testing.assert_array_equal(np.sort(got), np.sort(np.concatenate([*done, first.remaining_samples()])))
        if isinstance(first, BalancedBatchSampler):
            np.testing.assert_array_equal(np.sort(got), np.arange(403))  # the planner drops nothing
    assert all(len(b) > 0 for b in rest), "a rank was given an empty batch"


def test_a_second_world_change_in_the_same_epoch_still_covers_it_once():
    make = _balanced(2)
    a = make()
    done = _trained(a, 5)
    b = make(rank=0, w=3)
    b.load_state_dict(a.state_dict())
    done += _trained(b, 4)
    c = make(rank=0, w=1)
    c.load_state_dict(b.state_dict())
    done += _trained(c, len(c))
    got = np.concatenate(done)
    np.testing.assert_array_equal(np.sort(got), np.arange(403))
