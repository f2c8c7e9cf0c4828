"""The process groups of ring, tree and hierarchical wait as long as the default group
(``dist.timeout_s``), not new_group's 30 minutes (issue 16, item 9)."""

from __future__ import annotations

import torch

from tests.harness import run_ranks


def _group_timeouts(rank: int, world_size: int) -> list[float]:
    import os

    from poise.comm.topology import Topology

    os.environ.update(GROUP_RANK=str(rank), LOCAL_RANK="0")  # one rank per node: a leader group too
    topology = Topology.discover()
    groups = [topology.world_group, topology.local_group, topology.leader_group]
    out = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups if g is not None]
    topology.close()
    return out


def test_topology_groups_take_the_default_groups_timeout():
    for timeouts in run_ranks(_group_timeouts, 2, timeout_s=23.0):
        assert timeouts and all(t == 23.0 for t in timeouts), timeouts
