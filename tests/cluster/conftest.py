"""Fixtures for tests on real network namespaces: skipped only where a cluster cannot be built."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from poise.cluster import net, topology
from poise.cluster.state import owned_prefix

_names = itertools.count()


def poise_namespaces(prefix: str = net.NS_PREFIX) -> list[str]:
    return [ns for ns in net.list_namespaces() if ns.startswith(prefix)]


@pytest.fixture(scope="session")
def cluster_support() -> None:
    """Skip, with the precise reason, where this machine cannot build a cluster."""
    try:
        net.require_support()
    except net.NetError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A state directory of this test's own (subprocesses inherit it through the environment);
    every cluster recorded in it is removed afterwards."""
    path = tmp_path / "cluster-state"
    monkeypatch.setenv("POISE_CLUSTER_STATE_DIR", str(path))
    yield path
    for name in sorted(p.stem for p in path.glob("*.json")):
        topology.down(name)


@pytest.fixture
def cluster_name(cluster_support: None, state_dir: Path) -> Iterator[str]:
    """A cluster name no other test run uses; the cluster is gone after the test, checked."""
    name = f"t{os.getpid()}_{next(_names)}"
    yield name
    topology.down(name)
    assert poise_namespaces(owned_prefix(name)) == []
