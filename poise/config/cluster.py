"""``[cluster]``: an emulated multi-node cluster on this machine, and what names and sizes a
cluster may have (``poise cluster`` uses the same checks)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from poise import units
from poise.config.fields import check_finite, setting

MAX_NODES = 64
# Lower-case letters, digits and '_': never '-', so "poise-<name>-" prefixes cannot overlap.
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def validate_name(name: str) -> str:
    """Returns ``name``; raises ValueError unless it is 1-32 of a-z, 0-9, '_' starting with a letter."""
    if not _NAME.match(name):
        raise ValueError(
            f"cluster name {name!r} is invalid: use 1-32 lower-case letters, digits or '_', starting with a letter"
        )
    return name


DEFAULT_LINK = units.format_rate_bit_per_s(10**9)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """An emulated multi-node cluster on this machine (see poise/cluster/): each node a network
    namespace behind a rate-shaped link. Needs root. ``dist.nproc`` is the workers per node."""

    nodes: int = setting(0, "emulated nodes to run the job on (0 = none: run on this machine's own network)")
    link: str = setting(DEFAULT_LINK, "rate of every node's link, each direction, e.g. 100mbit, 1gbit, 10gbit "
                                      "(a named cluster's own rate by default)")
    delay: str = setting("", "one-way delay added to each direction of every link, e.g. 2ms (needs netem)")
    name: str = setting("", "run on this cluster from 'poise cluster up' ('' = bring one up for the job, down after)")

    def __post_init__(self) -> None:
        check_finite("cluster", self)
        if isinstance(self.nodes, bool) or not 0 <= self.nodes <= MAX_NODES:
            raise ValueError(f"cluster.nodes={self.nodes!r} is invalid: allowed is 0..{MAX_NODES} (0 = no cluster)")
        if self.name:
            validate_name(self.name)
        rate_bit_per_s = units.link_rate_bit_per_s(self.link)
        units.link_delay_s(self.delay)
        if not self.enabled and (rate_bit_per_s != units.link_rate_bit_per_s(DEFAULT_LINK) or self.delay):
            raise ValueError("cluster.link and cluster.delay only apply with cluster.nodes >= 1 or cluster.name")

    @property
    def enabled(self) -> bool:
        """Whether the job runs on an emulated cluster."""
        return self.nodes > 0 or bool(self.name)

    @property
    def link_rate_bit_per_s(self) -> int:
        """The link rate in bits per second."""
        return units.link_rate_bit_per_s(self.link)

    @property
    def delay_s(self) -> float:
        """The one-way link delay in seconds (0 = none)."""
        return units.link_delay_s(self.delay)

