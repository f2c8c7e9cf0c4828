"""The deadline plan's pure parts: nothing dropped or trained twice, whatever each rank
reaches; the deadline; delays and predictors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.config import DelaySpec, EmulateConfig, StragglerConfig
from poise.emulate.delays import DelayModel
from poise.straggler.claims import LocalClaims
from poise.straggler.predict import evaluate, make_predictor
from poise.straggler.queues import build_queues, catch_up, deadline_s, pool_after, split_micro
from poise.sync.deadline import DeadlineRunner, StepPlan


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 4), steps=st.integers(1, 12), micro=st.integers(1, 5), per_rank=st.integers(1, 9),
       seed=st.integers(0, 10_000))
def test_every_sample_of_the_epoch_is_trained_exactly_once(world, steps, micro, per_rank, seed):
    """Random reach per rank per step (0 = computed nothing), then catch-up steps until the
    pool is empty: the trained samples are the epoch's, each once."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(world * steps * per_rank)
    plan = [[order[(s * world + r) * per_rank:(s * world + r + 1) * per_rank] for r in range(world)]
            for s in range(steps)]
    pool = np.zeros(0, dtype=np.int64)
    micro_samples = max(1, math.ceil(per_rank / micro))
    trained: list[int] = []
    for batches in plan:
        queues = build_queues(batches, pool, micro, micro_samples)
        taken = np.array([rng.integers(0, len(q) + 1) for q in queues.micro])
        trained += queues.computed(taken).tolist()
        pool = pool_after(queues, taken)
    rounds = 0
    while len(pool):
        batches, rest = catch_up(pool, world, micro, micro_samples)
        queues = build_queues(batches, rest, micro, micro_samples)
        # at least one rank reaches something in a catch-up step (no deadline after an empty step)
        taken = np.array([rng.integers(0, len(q) + 1) for q in queues.micro])
        if not taken.any():
            taken[int(np.argmax([len(q) for q in queues.micro]))] = 1
        trained += queues.computed(taken).tolist()
        pool = pool_after(queues, taken)
        rounds += 1
        assert rounds < 10_000
    assert sorted(trained) == sorted(order.tolist())


def test_micro_batches_split_a_batch_in_order():
    parts = split_micro(np.arange(10), 4)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert len(split_micro(np.arange(2), 4)) == 2 and split_micro(np.zeros(0, dtype=np.int64), 4) == []


def test_the_pool_is_one_shared_list_and_what_nobody_took_goes_back_oldest_first():
    queues = build_queues([np.arange(4), np.arange(4, 8)], np.arange(100, 105), 2, 2)
    assert queues.planned == [2, 2] and queues.world == 2
    assert [m.tolist() for m in queues.micro[0]] == [[0, 1], [2, 3]]
    assert [m.tolist() for m in queues.micro[2]] == [[100, 101], [102, 103], [104]]
    # rank 0 takes its own list, then the pool, then its neighbour's; rank 1 its own, pool, rank 0's
    assert queues.order(0) == [0, 2, 1] and queues.order(1) == [1, 2, 0]
    # both of list 0, one of list 1, one pool chunk: the pool's rest first, then 6, 7
    taken = np.array([2, 1, 1])
    assert sorted(queues.computed(taken).tolist()) == [0, 1, 2, 3, 4, 5, 100, 101]
    assert pool_after(queues, taken).tolist() == [102, 103, 104, 6, 7]


def test_claims_hand_out_each_micro_batch_once():
    claims = LocalClaims()
    assert [claims.claim(3, 0) for _ in range(3)] == [0, 1, 2]
    assert claims.claim(3, 1) == 0 and claims.claim(4, 0) == 0
    claims.forget(3)
    assert claims.claim(3, 0) == 0 and claims.claim(4, 0) == 1
    assert claims.claimed(4, 0) == 2 and claims.claimed(4, 7) == 0  # asking claims nothing
    assert claims.claim(4, 0) == 2


def _run_step(runner: DeadlineRunner, plan: StepPlan) -> tuple[list[bool], list[list[int]], int]:
    """One rank's micro-batches of ``plan`` with one backward each (no model): what ``arm`` was
    told before each (last or not), the micro-batches handed out, and the zero backwards run."""
    armed: list[bool] = []
    got: list[list[int]] = []
    zeros = 0

    def arm(last: bool) -> None:
        armed.append(last)
        plan.reduced = plan.reduced or last

    def zero_reduce() -> None:
        nonlocal zeros
        zeros += 1

    for batch in runner.micro_batches(plan, load=lambda indices: indices, arm=arm, zero_reduce=zero_reduce):
        got.append(batch.tolist())
        plan.backwards += 1
    return armed, got, zeros


@pytest.mark.parametrize("mode", ["deadline", "off"])
def test_the_last_micro_batch_reduces_when_nothing_is_left_to_claim(mode):
    """With no deadline binding, the micro-batch after which every list is claimed is armed as
    the last (DDP reduces during its backward); no zero backward follows it."""
    runner = DeadlineRunner(StragglerConfig(mode=mode, micro_batches=4), rank=0, world_size=1, costs=np.ones(16),
                            loss_terms=None, device=torch.device("cpu"))
    plan = runner.plan_step(0, [np.arange(8)])
    armed, _, zeros = _run_step(runner, plan)
    assert armed == [False, False, False, True] and not zeros


@pytest.mark.parametrize(("mode", "expected"), [("deadline", [False, False, True]),
                                                 ("off", [False, False, False, True])])
def test_a_rank_ends_when_the_others_can_take_the_rest_in_one_round(mode, expected):
    """4 ranks: rank 0 arms its last micro-batch once at most W - 2 = 2 are left unclaimed in
    every list (here its own list's last and one of rank 3's), leaving them to the other three;
    with deadline steps off it computes its whole share and nothing else."""
    claims = LocalClaims()
    runner = DeadlineRunner(StragglerConfig(mode=mode, micro_batches=4), rank=0, world_size=4, costs=np.ones(16),
                            loss_terms=None, device=torch.device("cpu"), claims=claims)
    plan = runner.plan_step(0, [np.arange(4 * r, 4 * r + 4) for r in range(4)])
    for lst, n in ((1, 4), (2, 4), (3, 3)):  # the other ranks already took all but one of rank 3's
        for _ in range(n):
            claims.claim(0, lst)
    armed, got, zeros = _run_step(runner, plan)
    assert not zeros
    assert armed == expected
    assert got == [[0], [1], [2], [3]][:len(expected)]
    assert claims.claimed(0, 0) == len(expected) and claims.claimed(0, 3) == 3  # rank 3's last is left to others


def test_the_deadline_follows_the_median_rank_not_the_slowest():
    rates = np.array([1.0, 1.0, 4.0])
    assert deadline_s(rates, np.array([2.0, 2.0, 2.0]), 0.1) == pytest.approx(2.2)
    assert deadline_s(np.array([1.0, math.nan]), np.array([1.0, 1.0]), 0.1) is None  # a rank has no prediction
    # two of three ranks know their rate: the median of those two
    assert deadline_s(np.array([1.0, math.nan, 3.0]), np.array([1.0, 1.0, 1.0]), 0.0) == pytest.approx(2.0)
    assert deadline_s(np.array([1.0, math.nan]), np.array([1.0, 0.0]), 0.1) == pytest.approx(1.1)  # idle rank


def test_delay_models_have_the_mean_they_say():
    for text in ("bernoulli:p=0.2,x=1,per=micro", "lognormal:mean=0.2,sigma=1", "pareto:mean=0.2,alpha=2.5",
                 "slow:rank=0,x=0.2"):
        model = DelayModel(DelaySpec.parse(text), seed=3)
        draws = [model.after_micro(0, s, m, 1.0) for s in range(400) for m in range(50)]
        assert np.mean(draws) == pytest.approx(0.2, rel=0.15), text
        assert model.spec.mean_inflation() == pytest.approx(0.2)
    step = DelayModel(DelaySpec.parse("bernoulli:p=0.2,x=1"), seed=1)
    hits = [step.before_step(r, s, 2.0) for r in range(4) for s in range(2000)]
    assert np.mean(hits) == pytest.approx(0.4, rel=0.1) and set(hits) == {0.0, 2.0}
    assert step.before_step(0, 0, None) == 0.0  # no prediction yet: no stall
    assert DelaySpec.parse("").enabled is False


@pytest.mark.parametrize(("text", "message"), [
    ("gamma:k=1", "straggler.delay model 'gamma' is unknown: allowed are bernoulli, lognormal, pareto, slow "
                    "(e.g. 'bernoulli:p=0.2,x=1')"),
    ("bernoulli:q=1", "straggler.delay 'bernoulli:q=1': 'q=1' is not one of p=, x=, per="),
    ("bernoulli:p=2", "straggler.delay 'bernoulli:p=2': p must be in [0, 1] and x in [0, 100]"),
    ("pareto:alpha=1", "straggler.delay 'pareto:alpha=1': alpha must be in (1, 100] (a finite mean)"),
    ("lognormal:mean=x", "straggler.delay 'lognormal:mean=x': mean='x' is not a number"),
])
def test_bad_delay_models_get_one_line(text, message):
    with pytest.raises(ValueError) as err:
        EmulateConfig(delay=text)
    assert str(err.value) == message


def test_bad_straggler_settings_get_one_line():
    with pytest.raises(ValueError, match=r"straggler.mode='sometimes' is unknown: allowed are off, deadline, "):
        StragglerConfig(mode="sometimes")
    with pytest.raises(ValueError, match=r"straggler.slack=nan"):
        StragglerConfig(slack=float("nan"))


@pytest.mark.parametrize("name", ["quantile", "ewma", "lstm"])
def test_predictors_find_the_typical_rate_under_stalls(name):
    rng = np.random.default_rng(0)
    typical = 1.0 + 0.05 * rng.standard_normal(300)
    stalls = np.where(rng.random(300) < 0.2, 1.0, 0.0)
    score = evaluate((typical * (1 + stalls)).tolist(), name, typical=typical.tolist())
    assert score["mdape_typical"] < (0.1 if name != "ewma" else 0.3)
    with pytest.raises(ValueError, match=r"straggler.predictor='arima' is unknown"):
        make_predictor("arima")


def test_the_deadline_counts_from_the_last_reduction_plus_the_usual_gap():
    runner = DeadlineRunner(StragglerConfig(mode="deadline"), rank=0, world_size=1, costs=np.ones(8),
                            loss_terms=None, device=torch.device("cpu"))
    queues = build_queues([np.arange(8)], np.zeros(0, dtype=np.int64), 4, 2)

    def plan(started_s: float, deadline_s: float | None = 1.0) -> StepPlan:
        return StepPlan(index=1, queues=queues, deadline_s=deadline_s, reference=8.0, started_s=started_s)

    assert runner._origin_s(plan(5.0)) == 5.0  # no reduction yet: the rank's own start
    runner._settled_s, runner._usual_gap_s = 100.0, 0.05
    late = plan(100.3)
    assert runner._origin_s(late) == pytest.approx(100.05)  # 0.25 s late: that much less time
    assert late.gap_s == pytest.approx(0.3)  # what it tells the others
    assert runner._origin_s(plan(100.04)) == 100.04  # never more time than from its own start
    assert runner._origin_s(plan(100.9)) == 100.9  # over half the deadline late: its own start
    assert runner._origin_s(plan(100.3, deadline_s=None)) == 100.3  # waiting for everyone
    runner._joined_late = True  # its watchdog entered the last reduction: the others went on without it
    assert runner._origin_s(plan(100.9)) == pytest.approx(100.05)
