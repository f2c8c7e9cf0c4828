"""Collective algorithms behind one interface: flat, ring, tree and hierarchical all-reduce.

Every algorithm is a :class:`Collective` with ``all_reduce(tensor)`` (sum over the group, in
place, returned as a future of ``tensor``) and ``all_gather(out, tensor)`` (every rank's
equal-sized ``tensor`` into ``out``, in rank order). Collectives only move bytes: they know
no codec and hold no reducer. Reducers (``reducers.py``) take one, so every codec runs over
every algorithm; compressing only between nodes is a reducer wrapper
(``wrappers.HierarchicalReducer``) built on :class:`Hierarchical`'s node phases. The
algorithms, with their cost for ``n`` ranks, ``S`` bytes, link latency ``a`` (seconds) and
time per byte ``b`` (seconds/byte):

- :class:`Flat`: the backend's own all-reduce (gloo's ring, NCCL's ring/tree). The baseline.
- :class:`Ring`: reduce-scatter then all-gather over point-to-point sends, ``2(n-1)`` steps of
  ``S/n`` bytes: ``2(n-1)a + 2(n-1)/n S b`` (bandwidth-optimal; Patarasuk & Yuan 2009). Each
  step's block is cut into segments that are all posted at once and summed as they arrive,
  so the additions overlap the transfer of the next segments (chunked, pipelined).
- :class:`Tree`: recursive doubling (Thakur, Rabenseifner & Gropp 2005), ``ceil(log2 n)`` steps
  of ``S`` bytes: ``log2(n) (a + S b)``; latency-optimal, for small messages. A world that is
  not a power of two first folds its extra ranks into partners and hands them the result at
  the end (two more steps).
- :class:`Hierarchical`: sum inside each node onto its leader over a local group, all-reduce
  among one leader per node, broadcast inside the node, pipelined over segments. Only ``S``
  bytes per *node* cross the slow inter-node links instead of ``S`` per rank. Node
  membership comes from torchrun's ``GROUP_RANK`` and ``LOCAL_RANK``, gathered from every
  rank (:class:`Topology`).
- :class:`Auto`: chooses per message (the rule is in its docstring).

Modules: ``base.py`` (the interface and :class:`Flat`), ``threaded.py`` (ring and tree, and why
running them on a communication thread is safe), ``hierarchical.py``, ``auto.py``. This
package's :data:`COLLECTIVES` is the table from a name to its algorithm, and :func:`make`
builds one; ``poise/comm/registry.py`` offers each as a ``comm.collective`` name.
"""

from __future__ import annotations

import torch.distributed as dist

from poise.comm.collectives.auto import Auto
from poise.comm.collectives.base import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_BYTES,
    Collective,
    Flat,
    NodePhases,
)
from poise.comm.collectives.hierarchical import Hierarchical
from poise.comm.collectives.threaded import Ring, Tree
from poise.comm.topology import CommThread, NodeLayout, Topology

__all__ = ["COLLECTIVES", "Auto", "Collective", "CommThread", "Flat", "Hierarchical", "NodeLayout", "NodePhases",
           "Ring", "Topology", "Tree", "make"]

COLLECTIVES: dict[str, type[Collective]] = {cls.name: cls for cls in (Flat, Ring, Tree, Hierarchical, Auto)}


def make(name: str, group: dist.ProcessGroup | None = None, *, topology: Topology | None = None,
         segment_bytes: int = DEFAULT_SEGMENT_BYTES, small_bytes: int = DEFAULT_SMALL_BYTES) -> Collective:
    """Build the collective called ``name`` (a key of :data:`COLLECTIVES`).

    Args:
        group: the process group; algorithms other than ``flat`` work on the whole default
            group only (their process groups are made from it).
        topology: shared groups and thread; discovered (a collective call on every rank) if
            None and the algorithm needs one.
        segment_bytes: ring and hierarchical pipeline segment, bytes. small_bytes: auto's tree
            threshold, bytes.

    Raises:
        ValueError: an unknown name (the valid ones listed), or a subgroup with a non-flat one.
    """
    if name not in COLLECTIVES:
        raise ValueError(f"collective {name!r} is unknown: allowed are {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name].create(group, lambda: topology if topology is not None else Topology.discover(),
                                    segment_bytes=segment_bytes, small_bytes=small_bytes)


