"""Who meets whom in outer-step synchronization: ``sync.inner_scope`` and the node layout.

``inner_scope=rank`` (the default): every rank is its own replica between outer steps, and the
outer step averages over the whole world. ``inner_scope=node``: the ``L`` ranks of a node
(``LOCAL_WORLD_SIZE`` consecutive ranks, as torchrun numbers them node after node, the layout
``torch-localsgd`` uses too) are one replica: DDP all-reduces their gradients every step within
the node, so they hold the same parameters throughout, and only the ``K`` nodes meet at the
outer step. Each rank then sends one ``L``-th of the node's change (the piece its local rank
owns) to the ranks of the same local rank on the other nodes, and the node's ranks all-gather
the reduced pieces over their own link afterwards: a node puts one model's change on the
inter-node link per outer step, where ``inner_scope=rank`` puts one per rank.

Loss weighting. DDP inside the node averages the ranks' gradients, so the step must weight
rank r's mean loss by ``L n_r / N_node`` (its share of the node's loss terms) for the node's
gradient to be the exact token-weighted mean over the node's batches; :attr:`Nodes.node_ranks`
names the ranks to compute that share over (``Outer.loss_scope``, which the session's step
reads). With the world's weights ``W n_r / N`` instead,
the node's gradient is that mean times ``K N_node / N``: exact with one node (then every step
is DDP's) or with nodes of equal terms, and a plain average of the nodes' gradients is the
world's exact gradient (:func:`average_across_nodes`, for steps that synchronize in full).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from poise.comm.state import Counters
from poise.comm.topology import default_group_timeout


@dataclass(frozen=True)
class Nodes:
    """The node layout of an outer strategy (see module doc).

    Attributes:
        scope: ``rank`` or ``node`` (``sync.inner_scope``).
        ranks_per_node: ``L``, ranks of a node.
        count: ``K``, nodes in the world.
        node, local_rank: this rank's node and its place in it.
        node_group: ``node`` scope: this node's ranks (the inner DDP's group); None otherwise.
        cross_group: ``node`` scope with several nodes: the ranks of this rank's local rank, one
            per node (where its piece of the outer change is reduced); None otherwise.
    """

    scope: str
    ranks_per_node: int
    count: int
    node: int
    local_rank: int
    node_group: dist.ProcessGroup | None = None
    cross_group: dist.ProcessGroup | None = None

    @property
    def by_node(self) -> bool:
        """Whether a node's ranks train as one replica."""
        return self.scope == "node"

    @property
    def spans_nodes(self) -> bool:
        """Whether the outer step's collective crosses nodes (it does whenever there are several)."""
        return self.count > 1

    @property
    def shards(self) -> int:
        """Pieces the outer change is cut into, one per rank of a node (1: each rank sends all)."""
        return self.ranks_per_node if self.by_node else 1

    @property
    def lone(self) -> bool:
        """``node`` scope on one node: the outer step has no one to meet."""
        return self.by_node and self.count == 1

    @property
    def node_ranks(self) -> range:
        """The ranks of this rank's node."""
        return range(self.node * self.ranks_per_node, (self.node + 1) * self.ranks_per_node)

    @property
    def replicas(self) -> int:
        """Replicas the outer step averages over: the nodes, or every rank."""
        return self.count if self.by_node else self.count * self.ranks_per_node

    @property
    def replica(self) -> int:
        """This rank's replica (its node, or itself)."""
        return self.node if self.by_node else self.node * self.ranks_per_node + self.local_rank


def ranks_per_node(world_size: int, given: int | None = None) -> int:
    """``given``, else ``LOCAL_WORLD_SIZE`` (torchrun's and ``poise train``'s workers per node),
    else the whole world (one node)."""
    return given if given is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def make_nodes(scope: str, rank: int, world_size: int, per_node: int | None = None) -> Nodes:
    """The layout of ``scope`` for ``rank``; ``node`` scope creates the node and cross-node
    groups (a collective call: every rank calls it at the same point).

    Raises:
        ValueError: one line, when ``node`` scope's ranks per node do not divide the world.
    """
    size = ranks_per_node(world_size, per_node)
    if scope != "node":  # the layout only says which collectives cross nodes
        size = size if 1 <= size <= world_size and world_size % size == 0 else world_size
        return Nodes(scope, size, world_size // size, rank // size, rank % size)
    if not 1 <= size <= world_size or world_size % size:
        raise ValueError(f"sync.inner_scope='node': {size} ranks per node (LOCAL_WORLD_SIZE) do not divide the world "
                         f"of {world_size} ranks into nodes")
    count = world_size // size
    timeout = default_group_timeout()
    node_group, _ = dist.new_subgroups(group_size=size, timeout=timeout)
    cross_group = None
    if count > 1:
        cross_group, _ = dist.new_subgroups_by_enumeration(
            [[k * size + j for k in range(count)] for j in range(size)], timeout=timeout)
    return Nodes(scope, size, count, rank // size, rank % size, node_group, cross_group)


def piece(flat: torch.Tensor, nodes: Nodes) -> torch.Tensor:
    """This rank's piece of ``flat``: the ``local_rank``-th of ``shards`` equal parts, the last
    padded with zeros (a copy; ``flat`` itself when there is one part)."""
    if nodes.shards == 1:
        return flat
    size = -(-flat.numel() // nodes.shards)
    out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    part = flat[nodes.local_rank * size: (nodes.local_rank + 1) * size]
    out[: part.numel()].copy_(part)
    return out


def assemble(mine: torch.Tensor, numel: int, nodes: Nodes, counters: Counters) -> torch.Tensor:
    """The whole tensor of ``numel`` entries from every rank's reduced piece: an all-gather
    within the node (its bytes counted in ``counters``: they cross no node)."""
    if nodes.shards == 1:
        return mine[:numel]
    parts = [torch.empty_like(mine) for _ in range(nodes.shards)]
    dist.all_gather(parts, mine, group=nodes.node_group)
    size = mine.numel() * mine.element_size()
    counters.add(raw_bytes=size, wire_bytes=size)
    return torch.cat(parts)[:numel]


def average_across_nodes(grads: Sequence[torch.Tensor], nodes: Nodes, cross: Counters, local: Counters) -> None:
    """Average ``grads`` (the node's all-reduced gradients, equal on its ranks) over the nodes,
    in place: each rank all-reduces its piece with the same local rank on the other nodes
    (bytes counted in ``cross``), then the node gathers the pieces (in ``local``). With the
    world's loss weights this is the world's exact gradient (module doc). Nothing happens on
    one node."""
    if not nodes.by_node or nodes.count == 1 or not grads:
        return
    flat = torch.cat([g.detach().reshape(-1) for g in grads])
    mine = piece(flat, nodes)
    mine.div_(nodes.count)  # div_, then sum: as DDP's average
    size = mine.numel() * mine.element_size()
    cross.add(raw_bytes=size, wire_bytes=size, buckets=1)
    dist.all_reduce(mine, group=nodes.cross_group)
    whole = assemble(mine, flat.numel(), nodes, local)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(whole[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


__all__ = ["Nodes", "assemble", "average_across_nodes", "make_nodes", "piece", "ranks_per_node"]
