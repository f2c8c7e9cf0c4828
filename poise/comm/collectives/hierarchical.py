"""Hierarchical all-reduce: sum inside each node, across nodes among leaders, then broadcast."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from poise.comm.collectives.base import all_gather_into_tensor
from poise.comm.collectives.threaded import Segmented


class Hierarchical(Segmented):
    """Sum onto each node's leader, all-reduce among leaders, broadcast inside each node.

    The three phases are pipelined over segments: while segment ``i`` crosses between nodes,
    segment ``i + 1`` is being summed inside the node and segment ``i - 1`` broadcast, so the
    slow inter-node step hides the fast local ones. :meth:`reduce_in_node` and
    :meth:`broadcast_in_node` are the node phases on whole tensors, for a reducer that puts
    its own inter-node step between them (``wrappers.HierarchicalReducer``).

    Args:
        topology: node layout, groups and thread (see :class:`Topology`).
        segment_bytes: pipeline segment, bytes.
    """

    name: ClassVar[str] = "hierarchical"
    sums_in_nodes_first: ClassVar[bool] = True

    def as_hierarchical(self) -> Hierarchical:
        return self

    def reduce_in_node(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over this node's ranks onto its leader (the other ranks' copies are
        left as the backend leaves them). Blocking: call on ``topology.thread`` only, in the
        same order on every rank of the node."""
        topo = self.topology
        if len(topo.node_ranks) > 1:
            dist.reduce(tensor, dst=topo.node_ranks[0], group=topo.local_group)

    def broadcast_in_node(self, tensor: torch.Tensor) -> None:
        """Copy the leader's ``tensor`` to every rank of its node. Blocking: call on
        ``topology.thread`` only, in the same order on every rank of the node."""
        topo = self.topology
        if len(topo.node_ranks) > 1:
            dist.broadcast(tensor, src=topo.node_ranks[0], group=topo.local_group)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == 0:
            return tensor
        topo = self.topology
        flat = tensor.view(-1)
        per = max(1, self.segment_bytes // flat.element_size())
        segments = [flat[lo:lo + per] for lo in range(0, flat.numel(), per)]
        leader, local = topo.node_ranks[0], len(topo.node_ranks) > 1
        across = topo.is_leader and topo.layout.num_nodes > 1
        # Every member of a node posts its local operations in one order: all reduces, then
        # the broadcasts in segment order (the leader's inter-node ones go to another group).
        reduced = [dist.reduce(s, dst=leader, group=topo.local_group, async_op=True) if local else None
                   for s in segments]
        crossing: list[Any] = []
        broadcasts = []
        for i, segment in enumerate(segments):
            if reduced[i] is not None:
                reduced[i].wait()
            crossing.append(dist.all_reduce(segment, group=topo.leader_group, async_op=True) if across else None)
            if i > 0:
                broadcasts.append(self._broadcast(segments[i - 1], crossing[i - 1], leader, local))
        broadcasts.append(self._broadcast(segments[-1], crossing[-1], leader, local))
        for work in broadcasts:
            if work is not None:
                work.wait()
        return tensor

    def _broadcast(self, segment: torch.Tensor, crossing: Any, leader: int, local: bool) -> Any:
        """Once ``segment`` has crossed between nodes, start broadcasting it inside the node."""
        if crossing is not None:
            crossing.wait()
        if not local:
            return None
        return dist.broadcast(segment, src=leader, group=self.topology.local_group, async_op=True)

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        chunk, flat = tensor.numel(), out.view(-1)
        if chunk == 0:
            return out
        widest = topo.layout.max_ranks_per_node
        node_block = torch.zeros(widest * chunk, dtype=tensor.dtype, device=tensor.device)
        leader = topo.node_ranks[0]
        if len(topo.node_ranks) > 1:
            parts = list(node_block[: len(topo.node_ranks) * chunk].split(chunk)) if topo.is_leader else None
            dist.gather(tensor.view(-1), parts, dst=leader, group=topo.local_group)
        else:
            node_block[:chunk].copy_(tensor.view(-1))
        if topo.is_leader:
            every = torch.empty(topo.layout.num_nodes * widest * chunk, dtype=tensor.dtype, device=tensor.device)
            if topo.layout.num_nodes > 1:
                all_gather_into_tensor(every, node_block, group=topo.leader_group)
            else:
                every.copy_(node_block)
            for i, ranks in enumerate(topo.layout.nodes):
                for j, rank in enumerate(ranks):
                    start = (i * widest + j) * chunk
                    flat[rank * chunk:(rank + 1) * chunk].copy_(every[start:start + chunk])
        if len(topo.node_ranks) > 1:
            dist.broadcast(flat, src=leader, group=topo.local_group)
        return out

