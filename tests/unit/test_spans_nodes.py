"""Which all-reduces cross a node link: torchrun numbers ranks node after node."""

from __future__ import annotations

import pytest

from poise.comm.topology import spans_nodes


@pytest.mark.parametrize(("per_node", "ranks", "spans"), [
    ("2", [0, 1], False), ("2", [0, 1, 2, 3], True), ("2", [1, 2], True), ("4", [0, 1, 2, 3], False),
    ("1", [0, 1], True), (None, [0, 1, 2, 3], False),
])
def test_spans_nodes_from_local_world_size(monkeypatch: pytest.MonkeyPatch, per_node: str | None,
                                           ranks: list[int], spans: bool) -> None:
    if per_node is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", per_node)
    assert spans_nodes(ranks) is spans


def test_an_explicit_ranks_per_node_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert spans_nodes(range(4), 2) is True
    assert spans_nodes(range(4), 4) is False
