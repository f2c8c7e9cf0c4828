import numpy as np
import pytest

from poise.balance import balance, balance_ceiling, idle_fraction


def test_balance_definition():
    assert balance([1.0, 1.0]) == 1.0
    assert balance([1.0, 2.0]) == pytest.approx(0.5)
    assert balance([3.0]) == 1.0
    assert balance([0.0, 0.0]) == 1.0
    assert balance([0.9, 1.0, 0.95]) == pytest.approx(0.9)


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [-1.0, 1.0]])
def test_balance_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        balance(bad)


def test_idle_fraction():
    # step 1: ranks 1 s and 2 s -> 1 of 4 rank-seconds idle; step 2: equal -> none idle
    t = np.array([[1.0, 2.0], [1.0, 1.0]])
    assert idle_fraction(t) == pytest.approx(1.0 / 6.0)
    with pytest.raises(ValueError):
        idle_fraction(np.array([1.0, 2.0]))


def _table(step_s: list[list[float]]) -> np.ndarray:
    """A gathered timeline of ``step_s`` (``[ranks][steps]``), 10 samples of 100 tokens per rank-step."""
    from poise.diagnostics.timeline import FIELDS

    steps = np.asarray(step_s)
    table = np.zeros((*steps.shape, len(FIELDS)))
    table[:, :, FIELDS.index("step_s")] = steps
    table[:, :, FIELDS.index("forward_s")] = 0.5
    table[:, :, FIELDS.index("samples")] = 10
    table[:, :, FIELDS.index("tokens")] = 100
    return table


def test_throughput_counts_a_step_that_overlaps_the_next_once():
    from poise.diagnostics.report import steady_throughput, summarize
    from poise.diagnostics.timeline import elapsed_s

    # deadline steps: rank 1 stalls 0.5 s past step 1's reduction (the watchdog entered it for
    # the rank) and starts step 2 late, with 0.5 s left; both ranks spend 4 s in 4 steps.
    overlapping = _table([[1.0, 1.0, 1.0, 1.0], [1.0, 1.5, 0.5, 1.0]])
    assert elapsed_s(overlapping).tolist() == [1.0, 2.5, 3.0, 4.0]
    report = summarize(overlapping)
    assert report["throughput_samples_per_s"] == pytest.approx(80 / 4.0)  # not 80 / 4.5: each step's slowest
    assert report["elapsed_s_per_step"][-1] == pytest.approx(4.0)
    assert report["step_s_per_step"] == [1.0, 1.5, 1.0, 1.0]  # a step's slowest rank, as before
    assert steady_throughput(overlapping) == (pytest.approx(60 / 3.0), pytest.approx(600 / 3.0))
    assert report["steady_throughput_samples_per_s"] == pytest.approx(20.0)
    # synchronous steps: every rank leaves each all-reduce together; the same as each step's slowest
    synchronous = _table([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]])
    assert summarize(synchronous)["throughput_samples_per_s"] == pytest.approx(60 / 4.0)


def _steps(noise: np.ndarray, speeds: tuple[float, float] = (2.0, 1.0), alpha: float = 1e-3,
           steps: int = 120) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[ranks, steps] samples, padded tokens and seconds of bucketed steps: rank r's step takes
    its padded cost / speeds[r], times exp(noise[r, step])."""
    rng = np.random.default_rng(0)
    length = rng.integers(50, 1000, size=steps).astype(float)
    n = np.stack([np.full(steps, 8.0), np.full(steps, 4.0)])
    padded = n * length
    cost = padded + alpha * padded * length
    return n, padded, cost / np.asarray(speeds)[:, None] * 1e-4 * np.exp(noise)


def test_balance_ceiling_is_what_the_per_step_scatter_leaves():
    rng = np.random.default_rng(1)
    # times exactly as the cost model says, even with shares that do not match the speeds
    assert balance_ceiling(*_steps(np.zeros((2, 120)))) == pytest.approx(1.0, abs=1e-6)
    # what all ranks share in a step (the machine) costs no balance
    common = np.repeat(0.2 * rng.standard_normal((1, 120)), 2, axis=0)
    assert balance_ceiling(*_steps(common)) == pytest.approx(1.0, abs=1e-3)
    # independent log-normal scatter of 0.1 per rank: the log ratio has sd 0.1·√2, and a
    # step's balance is exp(-|log ratio|): about 0.896 on average
    independent = 0.1 * rng.standard_normal((2, 120))
    assert balance_ceiling(*_steps(independent)) == pytest.approx(0.896, abs=0.015)
    assert balance_ceiling(*(a[:, :7] for a in _steps(independent))) is None  # too few steps
