"""α-β costs of the collectives poise runs, on a cluster of nodes × workers per node.

The latency-bandwidth model (Hockney 1994): a message of ``S`` bytes over a link costs
``α + S β`` seconds, ``α`` the latency, ``β = 1 / bandwidth``. The algorithms are those of
Thakur, Rabenseifner & Gropp (2005), "Optimization of collective communication operations in
MPICH", with the bandwidth terms of nccl-tests (``doc/PERFORMANCE.md``): an all-reduce moves
``2(n-1)/n S`` bytes over each rank's link, an all-gather of ``S`` gathered bytes ``(n-1)/n S``.

A :class:`Cluster` has ``num_nodes`` nodes of ``procs_per_node`` ranks, ranks numbered node
by node. ``intra`` is one rank's link inside a node (NVLink, loopback); ``inter`` is one
node's link to the others (all of its NICs together): a ring that crosses nodes sends one
stream over each node's link, recursive doubling sends every rank's message at once.

- :func:`ring_all_reduce_s`: reduce-scatter + all-gather, ``2(n-1)`` steps of ``S/n``; every
  step waits for its slowest edge: ``2(n-1) (α + S/n β)`` on the node links. gloo's and
  NCCL's ring (``flat``) and poise's ``ring``.
- :func:`tree_all_reduce_s`: recursive doubling, ``log2 n`` exchanges of ``S`` (two more to
  fold ranks beyond a power of two); a step whose partners sit on other nodes puts every
  such rank's ``S`` on the node's link at once.
- :func:`hierarchical_all_reduce_s`: reduce onto each node's leader, ring all-reduce among
  the leaders, broadcast inside the node, pipelined over segments (``collectives.Hierarchical``).
- :func:`pipelined_s`: a depth-``p`` pipeline of ``k`` segments costs
  ``(k + p - 1)(α + S/k β)``, with ``k`` the best whole number (as NCCL chunks messages);
  NVLink SHARP (NVLS) all-reduce is such a pipeline of depth 2 (reduce in the switch,
  multicast back), and it is what the published H200 table measures.
- :func:`all_gather_s`: ring, recursive doubling (Bruck) or hierarchical all-gather.

Everything here is a pure function of numbers: no process group, no torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ALL_REDUCE", "MAX_WORLD_SIZE", "Cluster", "Link", "all_gather_s", "all_reduce_s",
           "hierarchical_all_reduce_s", "pipelined_s", "ring_all_reduce_s", "tree_all_reduce_s"]

# The most ranks a cluster may have: recursive doubling's crossing pattern is computed over
# every rank once per shape (tens of MB at this size); the largest jobs run today have about
# 10^5 accelerators.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class Link:
    """One link of the α-β model.

    Attributes:
        latency_s: α, seconds per message.
        bandwidth_bytes_per_s: 1/β, bytes per second.
    """

    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.latency_s >= 0 or not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"a link needs latency_s >= 0 and bandwidth_bytes_per_s > 0, got {self.latency_s}, "
                             f"{self.bandwidth_bytes_per_s}")

    def time_s(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to send ``nbytes`` bytes as ``messages`` messages: ``messages α + nbytes β``."""
        return messages * self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """``num_nodes`` × ``procs_per_node`` ranks with an intra-node and an inter-node link.

    Attributes:
        num_nodes: nodes (>= 1). procs_per_node: ranks per node (>= 1).
        intra: one rank's link to the others of its node.
        inter: one node's link to the other nodes (every NIC of the node together).
    """

    num_nodes: int
    procs_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.procs_per_node < 1:
            raise ValueError(f"a cluster needs >= 1 node and >= 1 rank per node, got {self.num_nodes} x "
                             f"{self.procs_per_node}")
        if self.num_nodes * self.procs_per_node > MAX_WORLD_SIZE:
            raise ValueError(f"a cluster of {self.num_nodes} x {self.procs_per_node} = "
                             f"{self.num_nodes * self.procs_per_node} ranks is beyond what the model computes in "
                             f"bounded memory: allowed is at most {MAX_WORLD_SIZE} ranks")

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return self.num_nodes * self.procs_per_node

    def node_of(self, rank: int) -> int:
        """The node holding ``rank`` (ranks are numbered node by node)."""
        return rank // self.procs_per_node


def _ring_edge(cluster: Cluster) -> Link:
    """The slowest edge of a ring over every rank: a node link when the ring leaves a node."""
    return cluster.inter if cluster.num_nodes > 1 else cluster.intra


def ring_all_reduce_s(cluster: Cluster, nbytes: float) -> float:
    """Ring all-reduce of ``nbytes`` bytes: ``2(n-1)`` steps of ``nbytes/n`` over the slowest edge."""
    n = cluster.world_size
    if n == 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * _ring_edge(cluster).time_s(nbytes / n)


def _ring_all_gather_s(cluster: Cluster, chunk_bytes: float) -> float:
    n = cluster.world_size
    if n == 1 or chunk_bytes <= 0:
        return 0.0
    return (n - 1) * _ring_edge(cluster).time_s(chunk_bytes)


def _doubling_ranks(n: int) -> tuple[np.ndarray, int]:
    """The ``p`` ranks that take part in recursive doubling (the largest power of two <= n)
    after the extra ones folded into their odd neighbours, and the number folded."""
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    v = np.arange(p, dtype=np.int64)
    return np.where(v < extra, 2 * v + 1, v + extra), extra


@functools.lru_cache(maxsize=64)
def _tree_shape(num_nodes: int, procs_per_node: int) -> tuple[tuple[tuple[int, bool], ...], bool]:
    """Who crosses nodes in recursive doubling, which depends on the cluster's shape only: per
    exchange step (distance 1, 2, 4...), the most ranks of one node whose partner sits on
    another node, and whether any pair stays inside a node; and whether a folded pair straddles
    two nodes. Computed once per shape in O(n log n) (numpy, n <= MAX_WORLD_SIZE), so that each
    of a plan's buckets costs O(log n)."""
    real, extra = _doubling_ranks(num_nodes * procs_per_node)
    node = real // procs_per_node
    index = np.arange(len(real), dtype=np.int64)
    steps = []
    distance = 1
    while distance < len(real):
        crossing = node != node[index ^ distance]
        most = int(np.bincount(node[crossing]).max()) if crossing.any() else 0
        steps.append((most, bool(not crossing.all())))
        distance <<= 1
    folded = np.arange(extra, dtype=np.int64)
    straddle = bool(np.any(2 * folded // procs_per_node != (2 * folded + 1) // procs_per_node))
    return tuple(steps), straddle


def tree_all_reduce_s(cluster: Cluster, nbytes: float) -> float:
    """Recursive doubling (``collectives.Tree``): ``log2 p`` exchanges of ``nbytes``, plus a
    fold and an unfold of ``nbytes`` when ``n`` is not a power of two. In an exchange the
    crossing ranks of a node share its link, the others use their own intra-node link, and
    the step waits for the slowest."""
    n = cluster.world_size
    if n == 1 or nbytes <= 0:
        return 0.0
    steps, straddle = _tree_shape(cluster.num_nodes, cluster.procs_per_node)
    total = 0.0
    for most, local in steps:
        times = [cluster.inter.time_s(most * nbytes)] if most else []
        if local:
            times.append(cluster.intra.time_s(nbytes))
        total += max(times)
    if n & (n - 1):  # ranks 2i and 2i + 1 (i < extra): their own link, or the node's if they straddle nodes
        total += 2 * (cluster.inter if straddle else cluster.intra).time_s(nbytes)
    return total


def _node_reduce_s(cluster: Cluster, nbytes: float) -> float:
    """Reduce onto the node's leader: reduce-scatter then gather, ``2(g-1)/g nbytes`` each rank."""
    g = cluster.procs_per_node
    if g == 1 or nbytes <= 0:
        return 0.0
    return 2 * (g - 1) * cluster.intra.time_s(nbytes / g)


def _node_broadcast_s(cluster: Cluster, nbytes: float) -> float:
    """Broadcast from the node's leader: a binomial tree, ``ceil(log2 g)`` sends of ``nbytes``."""
    g = cluster.procs_per_node
    if g == 1 or nbytes <= 0:
        return 0.0
    return math.ceil(math.log2(g)) * cluster.intra.time_s(nbytes)


def _leader_cluster(cluster: Cluster) -> Cluster:
    """The leaders alone: one rank per node, each with its node's link."""
    return Cluster(cluster.num_nodes, 1, cluster.intra, cluster.inter)


def hierarchical_phases_s(cluster: Cluster, nbytes: float) -> tuple[float, float, float]:
    """Seconds of the three phases on ``nbytes`` at once: node reduce, leaders' ring, node broadcast."""
    return (_node_reduce_s(cluster, nbytes), ring_all_reduce_s(_leader_cluster(cluster), nbytes),
            _node_broadcast_s(cluster, nbytes))


def hierarchical_all_reduce_s(cluster: Cluster, nbytes: float, segment_bytes: float | None = None) -> float:
    """Reduce in the node, ring among leaders, broadcast in the node (``collectives.Hierarchical``).

    With ``segment_bytes`` the phases are pipelined over ``k`` segments: the first segment
    goes through all three, each further one adds the slowest phase. None: one segment.
    """
    if nbytes <= 0 or cluster.world_size == 1:
        return 0.0
    k = max(1, math.ceil(nbytes / segment_bytes)) if segment_bytes else 1
    phases = hierarchical_phases_s(cluster, nbytes / k)
    return sum(phases) + (k - 1) * max(phases)


def pipelined_s(link: Link, nbytes: float, depth: int) -> float:
    """A depth-``depth`` pipeline of ``k`` segments, ``k`` the best whole number:
    ``min_k (k + depth - 1)(α + nbytes/k β)``.

    The continuous optimum is ``k* = sqrt((depth - 1) nbytes β / α)``; the whole numbers on
    either side of it are tried (1 for small messages).
    """
    if nbytes <= 0:
        return 0.0
    a, b = link.latency_s, 1.0 / link.bandwidth_bytes_per_s
    best_k = math.sqrt((depth - 1) * nbytes * b / a) if a > 0 else float(max(1, math.ceil(nbytes)))
    candidates = {1, max(1, math.floor(best_k)), max(1, math.ceil(best_k))}
    return min((k + depth - 1) * (a + nbytes * b / k) for k in candidates)


ALL_REDUCE = {
    "flat": ring_all_reduce_s,
    "ring": ring_all_reduce_s,
    "tree": tree_all_reduce_s,
    "hierarchical": hierarchical_all_reduce_s,
}


def resolve(algorithm: str, cluster: Cluster, nbytes: float, small_bytes: float = 64 << 10) -> str:
    """``auto``'s choice (``collectives.Auto``), or ``algorithm`` itself."""
    if algorithm != "auto":
        return algorithm
    if cluster.num_nodes > 1 and cluster.procs_per_node > 1:
        return "hierarchical"
    return "tree" if cluster.world_size > 1 and nbytes <= small_bytes else "flat"


def all_reduce_s(cluster: Cluster, nbytes: float, algorithm: str = "flat", segment_bytes: float | None = None) -> float:
    """Seconds to all-reduce ``nbytes`` bytes with ``algorithm`` (a key of :data:`ALL_REDUCE` or auto).

    Raises:
        ValueError: an unknown algorithm.
    """
    name = resolve(algorithm, cluster, nbytes)
    if name not in ALL_REDUCE:
        raise ValueError(f"collective {algorithm!r} is unknown: allowed are {', '.join([*ALL_REDUCE, 'auto'])}")
    if name == "hierarchical":
        return hierarchical_all_reduce_s(cluster, nbytes, segment_bytes)
    return ALL_REDUCE[name](cluster, nbytes)


def all_gather_s(cluster: Cluster, chunk_bytes: float, algorithm: str = "flat") -> float:
    """Seconds to all-gather ``chunk_bytes`` from every rank (``n chunk_bytes`` gathered).

    ``flat``/``ring``: ``n-1`` ring steps of one chunk. ``tree``: Bruck, ``ceil(log2 n)`` steps
    of doubling size. ``hierarchical``: gather to the leader, leaders' ring of a node's
    chunks, broadcast of everything inside the node.
    """
    n = cluster.world_size
    if n == 1 or chunk_bytes <= 0:
        return 0.0
    name = resolve(algorithm, cluster, n * chunk_bytes)
    if name in ("flat", "ring"):
        return _ring_all_gather_s(cluster, chunk_bytes)
    if name == "tree":
        total, have, distance = 0.0, 1, 1
        while have < n:
            count = min(distance, n - have)
            # rank r exchanges with r +- distance: a node's ranks cross at once when distance >= g
            crossing = min(distance, cluster.procs_per_node) if cluster.num_nodes > 1 else 0
            link, many = (cluster.inter, crossing) if crossing else (cluster.intra, 1)
            total += link.time_s(many * count * chunk_bytes)
            have += count
            distance <<= 1
        return total
    if name == "hierarchical":
        g = cluster.procs_per_node
        gather = (g - 1) * cluster.intra.time_s(chunk_bytes) if g > 1 else 0.0
        leaders = _ring_all_gather_s(_leader_cluster(cluster), g * chunk_bytes)
        return gather + leaders + _node_broadcast_s(cluster, n * chunk_bytes)
    raise ValueError(f"collective {algorithm!r} is unknown: allowed are flat, ring, tree, hierarchical, auto")
