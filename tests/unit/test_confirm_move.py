"""Do no harm under balance auto: a move of the shares is kept only if the steps after it are
measured no worse balanced than those before it (poise/balance/rebalance.py, "Confirmation").
Driven by recorded measurements, never by what this machine measures."""

import numpy as np

from poise.balance import make_sampler
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.speeds import move_confirmed, step_balance

LENGTHS = np.full(400, 32)  # every sample alike: one cost unit is one sample's work


def _steps(seconds_0: float, seconds_1: float, steps: int, n: float = 8.0) -> list[np.ndarray]:
    """``steps`` recorded steps of two ranks: n samples of 32 tokens each, in the given seconds."""
    return [np.array([[n * 32, n * 32 * 32, seconds_0], [n * 32, n * 32 * 32, seconds_1]]) for _ in range(steps)]


def _partitioner() -> DynamicPartitioner:
    sampler = make_sampler("auto", LENGTHS, rank=0, world_size=2, batch_size=8)
    return DynamicPartitioner(sampler, cold_start_steps=2, replan_every_steps=1, confirm_steps=3, fit_alpha=False)


def _drive(p: DynamicPartitioner, window: list[np.ndarray], start: int, until: str = "") -> list[str]:
    """Re-plan after each recorded step from ``start`` on (up to the first ``until`` decision);
    the decisions taken."""
    taken = []
    for k in range(start, len(window) + 1):
        p._observed = k + 1  # the first step of a process is not observed
        taken.append(p.decide(np.stack(window[:k], axis=1), step=k).decision)
        if taken[-1] == until:
            del window[k:]  # what follows the move is the caller's to record
            break
    return taken


def test_the_measured_balance_of_a_step_is_mean_over_slowest():
    assert step_balance(np.array([[1.0, 2.0], [0.5, 2.0]])).tolist() == [0.75, 1.0]
    kept, before, after = move_confirmed(np.array([[1.0] * 6, [2.0] * 3 + [1.1] * 3]), 3)
    assert kept and (before, round(after, 3)) == (0.75, 0.955)


def test_a_move_that_pays_is_confirmed_and_kept():
    p = _partitioner()
    window = _steps(1.0, 2.0, 4)  # rank 1 at half speed: 2 s for what rank 0 does in 1 s
    assert _drive(p, window, 2, until="jump")[-1] == "jump"
    moved = p.shares.copy()
    assert moved[0] > 0.6
    window += _steps(1.0 * moved[0] / 0.5, 2.0 * moved[1] / 0.5, 3)  # the steps after the move: balanced
    assert _drive(p, window, len(window) - 2) == ["trial", "trial", "confirm"]
    assert np.allclose(p.shares, moved)


def test_a_move_whose_steps_measure_worse_is_undone_and_not_retried_at_once():
    p = _partitioner()
    window = _steps(1.0, 1.3, 4)  # rank 1 reads slower ...
    assert _drive(p, window, 2, until="jump")[-1] == "jump"
    before = np.array([0.5, 0.5])
    assert not np.allclose(p.shares, before)
    window += _steps(0.6, 2.0, 3)  # ... but after the move it is rank 1 that waits far longer
    assert _drive(p, window, len(window) - 2) == ["trial", "trial", "revert"]
    assert np.allclose(p.shares, before) and np.allclose(p.sampler.speeds / p.sampler.speeds.sum(), before)
    assert p.history[-1].measured_balance[1] < p.history[-1].measured_balance[0]
    window += _steps(1.0, 1.3, 3)  # the same speeds as before the move: no move again right away
    assert set(_drive(p, window, len(window) - 2)) == {"hold"}
    assert np.allclose(p.shares, before)


def test_a_judged_move_survives_a_resume():
    p = _partitioner()
    window = _steps(1.0, 2.0, 4)
    _drive(p, window, 2, until="jump")
    state = p.state_dict()
    again = _partitioner()
    again.load_state_dict(state)
    assert again._trial is not None and np.allclose(again._trial[1], [0.5, 0.5])
