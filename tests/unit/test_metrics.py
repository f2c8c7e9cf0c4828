import numpy as np
import pytest

from poise.balance import balance, idle_fraction


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
