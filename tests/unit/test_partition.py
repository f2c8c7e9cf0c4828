"""Stage partitioning as pure functions: exact == brute force, valid plans, constraints, errors."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.balance import balance, describe_plan, partition, recommend, stage_times
from poise.balance.partition import all_plans
from poise.balance.stage_count import bubble_fraction, optimal_stage_count

costs_st = st.lists(st.floats(0.01, 10.0, allow_nan=False), min_size=1, max_size=10)


def _valid(plan, n, p):
    assert len(plan) == p + 1 and plan[0] == 0 and plan[-1] == n
    assert all(a < b for a, b in itertools.pairwise(plan))


def _feasible(plan, memory, cap, inseparable):
    m = np.concatenate([[0.0], np.cumsum(memory)]) if memory is not None else None
    if m is not None and any(m[j] - m[i] > cap * (1 + 1e-12) for i, j in itertools.pairwise(plan)):
        return False
    return not any(lo < cut <= hi for cut in plan[1:-1] for lo, hi in ((min(g), max(g)) for g in inseparable))


def _brute(costs, p, *, boundary_costs=None, memory=None, cap=None, inseparable=()):
    """(optimal bottleneck, best balance among optimal plans) over every feasible plan."""
    results = [
        (max(t := stage_times(costs, plan, boundary_costs=boundary_costs)), balance(t))
        for plan in all_plans(len(costs), p)
        if _feasible(plan, memory, cap, inseparable)
    ]
    if not results:
        return None
    best = min(r[0] for r in results)
    return best, max(b for t, b in results if t <= best * (1 + 1e-9))


@settings(max_examples=100, deadline=None)
@given(costs=costs_st, data=st.data())
def test_exact_reaches_the_brute_force_optimum_and_its_best_balance(costs, data):
    p = data.draw(st.integers(1, len(costs)))
    plan = partition(costs, p)
    _valid(plan, len(costs), p)
    summary = describe_plan(costs, plan)
    best, best_balance = _brute(costs, p)
    assert summary.bottleneck_s == pytest.approx(best, rel=1e-9)
    assert summary.balance == pytest.approx(best_balance, rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(costs=costs_st, data=st.data())
def test_exact_with_comm_memory_and_groups_matches_brute_force(costs, data):
    n = len(costs)
    p = data.draw(st.integers(1, n))
    comm = data.draw(st.lists(st.floats(0.0, 5.0), min_size=n - 1, max_size=n - 1))
    memory = data.draw(st.lists(st.floats(0.0, 100.0), min_size=n, max_size=n))
    cap = data.draw(st.floats(1.0, 400.0))
    groups = data.draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=3), max_size=2))
    reference = _brute(costs, p, boundary_costs=comm, memory=memory, cap=cap, inseparable=groups)
    kwargs = {"boundary_costs": comm, "memory": memory, "memory_cap": cap, "inseparable": groups}
    if reference is None:
        with pytest.raises(ValueError):
            partition(costs, p, **kwargs)
        return
    plan = partition(costs, p, **kwargs)
    _valid(plan, n, p)
    assert _feasible(plan, memory, cap, groups)  # constraints respected
    assert max(stage_times(costs, plan, boundary_costs=comm)) == pytest.approx(reference[0], rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=40), data=st.data())
def test_every_method_returns_a_valid_plan_and_exact_is_never_slower(costs, data):
    p = data.draw(st.integers(1, len(costs)))
    weights = data.draw(st.lists(st.integers(0, 1000), min_size=len(costs), max_size=len(costs)))
    exact = describe_plan(costs, partition(costs, p)).bottleneck_s
    for method, extra in (("uniform", {}), ("greedy", {}), ("parameters", {"weights": weights})):
        plan = partition(costs, p, method=method, **extra)
        _valid(plan, len(costs), p)
        assert describe_plan(costs, plan).bottleneck_s >= exact * (1 - 1e-12)


def test_baselines_on_known_cases():
    costs = [1.0] * 9 + [10.0]  # a heavy last layer (an output head)
    assert partition(costs, 3, method="uniform") == [0, 4, 7, 10]
    assert partition(costs, 3, method="greedy") == [0, 6, 9, 10]
    assert partition(costs, 3, method="parameters", weights=[1] * 10) == [0, 3, 6, 10]
    exact = partition(costs, 3)
    assert exact[-2] == 9 and describe_plan(costs, exact).bottleneck_s == 10.0
    # equal costs: every method agrees on an even split
    assert partition([2.0] * 8, 4) == partition([2.0] * 8, 4, method="uniform") == [0, 2, 4, 6, 8]


def test_comm_cost_moves_the_cut_to_a_small_boundary():
    # Without comm the best cut is in the middle (after layer 1); a costly boundary there
    # moves it to the free boundary after layer 2.
    costs = [1.0, 1.0, 1.0, 1.0]
    assert partition(costs, 2) == [0, 2, 4]
    assert partition(costs, 2, boundary_costs=[0.5, 5.0, 0.0]) == [0, 3, 4]


def test_memory_cap_and_inseparable_groups_are_respected():
    costs = [1.0] * 6
    assert partition(costs, 2, memory=[5, 5, 5, 1, 1, 1], memory_cap=11) == [0, 2, 6]
    assert partition(costs, 3, inseparable=[(0, 1, 2)]) in ([0, 3, 4, 6], [0, 3, 5, 6])
    assert partition(costs, 2, inseparable=[[4, 2]]) == [0, 2, 6]  # 2..4 stay together
    assert partition(costs, 2, inseparable=(g for g in [[4, 2]])) == [0, 2, 6]  # a generator works too


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([1.0, 1.0, 1.0], 4), {}, "num_stages=4 is more than the 3 layers"),
        (([1.0, 0.0, 1.0], 2), {}, "costs[1]=0.0 is invalid"),
        (([1.0, -2.0], 1), {}, "costs[1]=-2.0 is invalid"),
        (([], 1), {}, "costs is empty"),
        (([1.0, 1.0], 0), {}, "num_stages=0 is invalid"),
        (([1.0, 1.0, 1.0], 2), {"memory": [5, 5, 5], "memory_cap": 6},
         "memory_cap=6 bytes cannot be met by any split into 2 stages: the smallest feasible cap is 10 bytes"),
        (([1.0] * 4, 3), {"inseparable": [(0, 1, 2)]}, "leave 1 places to cut 4 layers"),
        (([1.0] * 4, 2), {"inseparable": [(3, 4)]}, "outside 0..3"),
        (([1.0] * 4, 2), {"method": "fastest"}, "method='fastest' is unknown"),
        (([1.0] * 4, 2), {"method": "parameters"}, "needs weights="),
        (([1.0] * 4, 2), {"method": "uniform", "memory_cap": 3.0, "memory": [1] * 4}, "does not take memory"),
        (([1.0] * 4, 2), {"boundary_costs": [1.0]}, "boundary_costs has 1 entries; need 3"),
        (([1.0] * 4, 2), {"memory": [1] * 4}, "give both or neither"),
    ],
)
def test_bad_input_is_a_one_line_error_naming_the_numbers(args, kwargs, message):
    with pytest.raises(ValueError) as err:
        partition(*args, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_describe_plan_and_stage_times():
    summary = describe_plan([1.0, 2.0, 3.0], [0, 2, 3], boundary_costs=[0.5, 0.25], memory=[1, 1, 4])
    assert summary.stage_s == [3.25, 3.25] and summary.balance == 1.0
    assert summary.stage_memory_bytes == [2.0, 4.0]
    with pytest.raises(ValueError, match="boundaries"):
        stage_times([1.0, 2.0], [0, 0, 2])


def test_bubble_fraction_and_recommendation():
    assert bubble_fraction(1, 1) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert optimal_stage_count(1.0, 0.25) == 5
    assert optimal_stage_count(1.0, 0.0) is None
    advice = recommend(t_comp_s=1.0, t_comm_s=0.25, num_layers=10, max_stages=8, batch_size=64)
    assert (advice.num_stages, advice.stages_limited_by) == (5, "N_opt")
    assert advice.num_micro_batches == 36 and advice.bubble_fraction <= 0.1
    assert advice.micro_batches_limited_by == "bubble target"
    small = recommend(t_comp_s=1.0, t_comm_s=0.0, num_layers=3, max_stages=8, batch_size=4)
    assert (small.num_stages, small.stages_limited_by) == (3, "layers")
    assert (small.num_micro_batches, small.micro_batches_limited_by) == (4, "batch size")
    assert recommend(t_comp_s=1.0, t_comm_s=1.0, num_layers=8, max_stages=8, batch_size=8,
                     min_stages=4).stages_limited_by == "memory"
    with pytest.raises(ValueError, match="t_comm_s=-1"):
        optimal_stage_count(1.0, -1.0)
