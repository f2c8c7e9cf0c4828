import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from poise.balance.sampler import BatchSchedule, rank_batches


def test_fixed_batches_cover_disjoint_equal_shares():
    lengths = np.arange(1, 101)
    per_rank = [rank_batches(lengths, rank=r, world_size=2, epoch=0, seed=3, batch_size=8) for r in range(2)]
    assert [len(b) for b in per_rank] == [6, 6]
    seen = [i for batches in per_rank for b in batches for i in b]
    assert len(seen) == len(set(seen)) == 96


def test_epochs_reshuffle_and_are_deterministic():
    lengths = np.ones(64, dtype=np.int64)
    a = rank_batches(lengths, rank=0, world_size=2, epoch=0, seed=1, batch_size=4)
    assert a == rank_batches(lengths, rank=0, world_size=2, epoch=0, seed=1, batch_size=4)
    assert a != rank_batches(lengths, rank=0, world_size=2, epoch=1, seed=1, batch_size=4)


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=8, max_size=300),
    world=st.integers(1, 4),
    budget=st.integers(64, 512),
    epoch=st.integers(0, 3),
)
def test_token_budget_batches_respect_budget_and_align_step_counts(lengths, world, budget, epoch):
    lengths = np.array(lengths)
    try:
        schedules = [BatchSchedule(lengths, rank=r, world_size=world, seed=0, batch_tokens=budget)
                     for r in range(world)]
    except ValueError:
        assume(False)  # too few samples for one step per rank: rejected, as it should be
    epochs = [s.epoch(epoch) for s in schedules]
    assert len({len(e) for e in epochs}) == 1  # every rank runs the same number of steps
    seen: list[int] = []
    for batches in epochs:
        for b in batches:
            assert max(lengths[b]) * len(b) <= budget
            seen += b
    assert len(seen) == len(set(seen))  # no sample twice in an epoch


def test_iter_steps_cycles_epochs_and_counts():
    lengths = np.ones(40, dtype=np.int64)
    s = BatchSchedule(lengths, rank=1, world_size=2, seed=0, batch_size=5)
    assert s.steps_in_epoch(0) == 4
    assert len(list(s.iter_steps(num_steps=10))) == 10 == s.total_steps(num_steps=10)
    assert len(list(s.iter_steps(num_epochs=3))) == 12 == s.total_steps(num_epochs=3)
