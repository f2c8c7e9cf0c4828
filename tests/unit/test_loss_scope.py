"""A step's loss weight over the ranks of its scope: the world, a node, or the rank alone."""

from __future__ import annotations

import numpy as np
import pytest

from poise.balance.weights import loss_weight
from poise.sync.base import LossScope

BATCHES = [np.arange(3), np.arange(7), np.arange(2), np.arange(12)]  # samples per rank: 3, 7, 2, 12


def test_the_world_scope_is_ddps_weight() -> None:
    assert LossScope().weight(BATCHES, 1, None) == loss_weight(BATCHES, 1) == pytest.approx(4 * 7 / 24)


@pytest.mark.parametrize(("rank", "ranks", "want"), [(0, range(0, 2), 2 * 3 / 10), (1, range(0, 2), 2 * 7 / 10),
                                                     (3, range(2, 4), 2 * 12 / 14)])
def test_a_node_scope_weighs_among_the_nodes_ranks(rank: int, ranks: range, want: float) -> None:
    assert LossScope(ranks).weight(BATCHES, rank, None) == pytest.approx(want)


def test_a_rank_alone_trains_on_its_plain_mean() -> None:
    scope = LossScope.alone(2)
    assert scope.own and not LossScope(range(0, 2)).own and not LossScope().own
    assert scope.weight(BATCHES, 2, None) == 1.0
    terms = np.arange(12, dtype=np.float64)  # loss terms per sample: the weight is still 1
    assert scope.weight(BATCHES, 2, terms) == 1.0
