"""The ``auto`` collective: an algorithm chosen per message by its size and the node layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from poise.comm.collectives.base import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_BYTES,
    Collective,
    Flat,
    Future,
    require_world,
)
from poise.comm.collectives.hierarchical import Hierarchical
from poise.comm.collectives.threaded import Tree
from poise.comm.topology import Topology


class Auto(Collective):
    """Chooses an algorithm per message; the rule (``S`` = bytes of the summed tensor, or of
    the gathered output):

    1. several nodes and some node with several ranks: :class:`Hierarchical`, whatever ``S``
       (only one copy per node crosses the slow links, and the three phases cost little more
       than one flat all-reduce when the links are equal);
    2. otherwise ``S <= small_bytes``: :class:`Tree` (``log2 n`` latencies instead of the
       ring's ``2(n-1)``);
    3. otherwise :class:`Flat`: the backend's own bandwidth-optimal algorithm, in C++.

    ``poise diagnose busbw`` measures every choice on a job's own network, to set
    ``small_bytes`` or to force one algorithm through ``comm.collective``.
    """

    name: ClassVar[str] = "auto"
    sums_in_nodes_first: ClassVar[bool] = True

    def __init__(self, topology: Topology, small_bytes: int = DEFAULT_SMALL_BYTES,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.topology = topology
        self.small_bytes = small_bytes
        self.flat = Flat()
        self.tree = Tree(topology)
        layout = topology.layout
        self.hierarchical = (Hierarchical(topology, segment_bytes=segment_bytes)
                             if layout.num_nodes > 1 and layout.max_ranks_per_node > 1 else None)

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Auto:
        require_world(cls.name, group)
        return cls(topology(), small_bytes, segment_bytes)

    def as_hierarchical(self) -> Hierarchical | None:
        return self.hierarchical

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def choose(self, nbytes: int) -> Collective:
        """The collective used for a message of ``nbytes`` bytes (rule in the class docstring)."""
        if self.hierarchical is not None:
            return self.hierarchical
        if self.world_size > 1 and nbytes <= self.small_bytes:
            return self.tree
        return self.flat

    def all_reduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return self.choose(tensor.numel() * tensor.element_size()).all_reduce(tensor)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return self.choose(out.numel() * out.element_size()).all_gather(out, tensor)

