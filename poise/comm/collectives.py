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

Threading. Multi-step algorithms (ring, tree, hierarchical) run on one communication thread
per process (:class:`~poise.comm.topology.CommThread`, with the node layout and process groups
in ``topology.py``), which takes jobs from a FIFO queue and completes a
``torch.futures.Future`` per job. The caller (DDP's autograd thread, inside a comm hook) only
enqueues and returns the future; it never waits for it, and no collective is ever started
from a future callback. This is safe with gloo because (and the same holds for NCCL, whose
communicators are per process group too; not yet run on GPUs):

1. The thread issues its operations only on process groups of its own (created once by
   :class:`Topology`: a copy of the world, the node groups and the leader group), which no
   other thread uses. Each group's operations therefore come in the queue's order, and the
   queue's order is the call order, the same on every rank (DDP reduces buckets in the same
   order on every rank). Operations of other threads on the default group travel on the
   default group's own connections and tags, so they can neither interleave nor match with
   these.
2. The thread waits only for its own group's operations, which every rank issues in the same
   order, so it cannot wait for something that depends on the caller's thread: there is no
   cycle, hence no deadlock. DDP waits for the futures at the end of ``backward()``.
3. Callbacks chained on the returned future (a reducer's decode) run on the thread that
   completes it, and they only compute locally. (``wrappers.HierarchicalReducer`` runs a
   whole job on the thread, the inter-node reducer included, and waits for that reducer's
   future there, never in a callback.)

On CUDA the job first waits for the caller's stream (an event recorded at submission), and
the thread synchronizes its own stream before completing the future, so the consumer sees the
finished sum.
"""

from __future__ import annotations

import abc
import itertools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from poise.comm.topology import CommThread, NodeLayout, Topology

__all__ = ["COLLECTIVES", "Auto", "Collective", "CommThread", "Flat", "Hierarchical", "NodeLayout", "Ring", "Topology",
           "Tree", "make"]

log = logging.getLogger(__name__)

Future = torch.futures.Future

# all_gather_single is the new name (torch >= 2.10); all_gather_into_tensor warns there.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 64 << 10


class Collective(abc.ABC):
    """A way to sum (and gather) tensors over a fixed group of ranks.

    Every rank must make the same calls in the same order, with tensors of the same size.
    """

    name: ClassVar[str]

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks taking part."""

    @classmethod
    @abc.abstractmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Collective:
        """The algorithm from :func:`make`'s arguments; ``topology()`` gives the shared groups
        and thread (discovering them, a collective call, the first time); flat never calls it."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        """Future of ``tensor`` after it was overwritten with the sum over the group.

        Args:
            tensor: flat and contiguous; every rank passes the same numel and dtype.
        """

    @abc.abstractmethod
    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Future[torch.Tensor]:
        """Future of ``out`` (``world_size * tensor.numel()`` entries) holding every rank's
        flat ``tensor`` in rank order."""

    def as_hierarchical(self) -> Hierarchical | None:
        """The :class:`Hierarchical` algorithm this collective sums every message with
        (hierarchical itself, or auto where its rule picks it for every size), or None; with
        one, a codec compresses only between nodes (``wrappers.compose``)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


class Flat(Collective):
    """The backend's own collectives, launched asynchronously from the caller's thread.

    Args:
        group: the process group (None: the default group).
    """

    name: ClassVar[str] = "flat"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Flat:
        return cls(group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return work.get_future().then(_resolve_to(tensor))

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Future[torch.Tensor]:
        work = _all_gather(out, tensor, group=self.group, async_op=True)
        return work.get_future().then(_resolve_to(out))


def _resolve_to(result: torch.Tensor) -> Callable[[Future[Any]], torch.Tensor]:
    """A callback that re-raises a failed collective, else yields ``result`` (the backend's
    future holds a list of tensors; ours hold the tensor itself)."""

    def done(fut: Future[Any]) -> torch.Tensor:
        fut.wait()
        return result

    return done


# -- ring and tree ------------------------------------------------------------------------------


def _spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous spans covering ``range(numel)``, sizes differing by at most one."""
    bounds = [i * numel // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


class _ThreadedCollective(Collective):
    """A collective whose algorithm runs on the topology's communication thread."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def all_reduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return self.topology.thread.submit(lambda: self._all_reduce(tensor), tensor.device)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Future[torch.Tensor]:
        assert out.numel() == tensor.numel() * self.world_size, (out.shape, tensor.shape)
        return self.topology.thread.submit(lambda: self._all_gather(out, tensor), tensor.device)

    @abc.abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The blocking algorithm, run on the communication thread."""

    @abc.abstractmethod
    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """The blocking algorithm, run on the communication thread."""


class _Segmented(_ThreadedCollective):
    """A threaded collective that sends its messages in pipelined segments of ``segment_bytes``."""

    def __init__(self, topology: Topology, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        super().__init__(topology)
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes={segment_bytes} must be positive")
        self.segment_bytes = segment_bytes

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Collective:
        _require_world(cls.name, group)
        return cls(topology(), segment_bytes)


class Ring(_Segmented):
    """Ring all-reduce: reduce-scatter then all-gather, ``2(n-1)`` neighbour steps.

    Args:
        topology: the process groups and thread.
        segment_bytes: pipeline segment (bytes): each step's block is sent in pieces of this
            size, all posted at once, each summed as soon as it has arrived.
    """

    name: ClassVar[str] = "ring"

    def _segments(self, lo: int, hi: int, itemsize: int) -> list[tuple[int, int]]:
        per = max(1, self.segment_bytes // itemsize)
        return [(s, min(s + per, hi)) for s in range(lo, hi, per)]

    def _step(self, send: torch.Tensor, recv_spans: list[tuple[int, int]], recv_into: torch.Tensor,
              send_spans: list[tuple[int, int]], on_arrival: Callable[[int, int, torch.Tensor], None]) -> None:
        """Send ``send``'s spans to the right neighbour while receiving ``recv_spans`` from the
        left one into ``recv_into``; call ``on_arrival`` per received segment, in order."""
        group, n, rank = self.topology.world_group, self.world_size, self.topology.rank
        right, left = (rank + 1) % n, (rank - 1) % n
        ops = [dist.P2POp(dist.irecv, recv_into[lo:hi], group=group, group_peer=left, tag=i)
               for i, (lo, hi) in enumerate(recv_spans)]
        ops += [dist.P2POp(dist.isend, send[lo:hi], group=group, group_peer=right, tag=i)
                for i, (lo, hi) in enumerate(send_spans)]
        if not ops:
            return
        # One batch: NCCL wants a step's sends and receives posted together and returns one
        # coalesced operation; gloo returns one per segment, each summed as soon as it arrives.
        works = dist.batch_isend_irecv(ops)
        separate = len(works) == len(ops)
        for work in () if separate else works:
            work.wait()
        for i, (lo, hi) in enumerate(recv_spans):
            if separate:
                works[i].wait()
            on_arrival(lo, hi, recv_into)
        for work in works[len(recv_spans):] if separate else ():
            work.wait()

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        n, rank = self.world_size, self.topology.rank
        if n == 1 or tensor.numel() == 0:
            return tensor
        flat = tensor.view(-1)
        blocks = _spans(flat.numel(), n)
        scratch = torch.empty_like(flat)
        size = flat.element_size()

        def add(lo: int, hi: int, src: torch.Tensor) -> None:
            flat[lo:hi].add_(src[lo:hi])

        # reduce-scatter: after step s, block (rank - s - 1) holds s + 2 ranks' sum here
        for s in range(n - 1):
            send_block, recv_block = blocks[(rank - s) % n], blocks[(rank - s - 1) % n]
            self._step(flat, self._segments(*recv_block, size), scratch, self._segments(*send_block, size), add)
        # all-gather: block (rank + 1) is complete here; pass complete blocks around the ring
        for s in range(n - 1):
            send_block, recv_block = blocks[(rank + 1 - s) % n], blocks[(rank - s) % n]
            self._step(flat, self._segments(*recv_block, size), flat, self._segments(*send_block, size),
                       lambda lo, hi, src: None)
        return tensor

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        n, rank = self.world_size, self.topology.rank
        flat, chunk = out.view(-1), tensor.numel()
        flat[rank * chunk:(rank + 1) * chunk].copy_(tensor.view(-1))
        size = flat.element_size()
        for s in range(n - 1):
            send_r, recv_r = (rank - s) % n, (rank - s - 1) % n
            self._step(flat, self._segments(recv_r * chunk, (recv_r + 1) * chunk, size), flat,
                       self._segments(send_r * chunk, (send_r + 1) * chunk, size), lambda lo, hi, src: None)
        return out


class Tree(_ThreadedCollective):
    """Recursive doubling: ``ceil(log2 n)`` exchanges of the whole message; for small messages.

    A world of ``n = p + extra`` ranks (``p`` the largest power of two ``<= n``) first folds
    ranks ``0, 2, ..., 2 extra - 2`` into their odd right neighbours, runs recursive doubling
    over the ``p`` remaining ranks, then sends the folded ranks the result. Both partners of an
    exchange compute ``a + b``, which IEEE makes identical on the two sides, so every rank ends
    with bit-identical sums. All-gather is Bruck's dissemination algorithm (any ``n``,
    ``ceil(log2 n)`` steps).
    """

    name: ClassVar[str] = "tree"

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Tree:
        _require_world(cls.name, group)
        return cls(topology())

    def _exchange(self, send: torch.Tensor, send_to: int, recv: torch.Tensor, recv_from: int) -> None:
        group = self.topology.world_group
        ops = [dist.P2POp(dist.irecv, recv, group=group, group_peer=recv_from),
               dist.P2POp(dist.isend, send, group=group, group_peer=send_to)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        n, rank = self.world_size, self.topology.rank
        if n == 1 or tensor.numel() == 0:
            return tensor
        group = self.topology.world_group
        flat = tensor.view(-1)
        p = 1 << (n.bit_length() - 1)
        extra = n - p
        if rank < 2 * extra and rank % 2 == 0:  # folded: hand the data over, wait for the sum
            dist.send(flat, group=group, group_dst=rank + 1)
            dist.recv(flat, group=group, group_src=rank + 1)
            return tensor
        scratch = torch.empty_like(flat)
        if rank < 2 * extra:
            dist.recv(scratch, group=group, group_src=rank - 1)
            flat.add_(scratch)
        vrank = rank // 2 if rank < 2 * extra else rank - extra

        def real(v: int) -> int:
            return 2 * v + 1 if v < extra else v + extra

        mask = 1
        while mask < p:
            peer = real(vrank ^ mask)
            self._exchange(flat, peer, scratch, peer)
            flat.add_(scratch)
            mask <<= 1
        if rank < 2 * extra:
            dist.send(flat, group=group, group_dst=rank - 1)
        return tensor

    def _all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        n, rank = self.world_size, self.topology.rank
        chunk = tensor.numel()
        flat = out.view(-1)
        if n == 1 or chunk == 0:
            flat.copy_(tensor.view(-1))
            return out
        # Bruck: slot j of the buffer holds rank (rank + j) % n's chunk. At distance d (= the
        # number of slots held), receive rank + d's first min(d, n - d) slots behind ours and
        # send our first ones to rank - d.
        rotated = torch.empty_like(flat)
        rotated[:chunk].copy_(tensor.view(-1))
        have, d = 1, 1
        while have < n:
            count = min(d, n - have)
            self._exchange(rotated[:count * chunk], (rank - d) % n,
                           rotated[have * chunk:(have + count) * chunk], (rank + d) % n)
            have += count
            d <<= 1
        for j in range(n):
            src = (rank + j) % n
            flat[src * chunk:(src + 1) * chunk].copy_(rotated[j * chunk:(j + 1) * chunk])
        return out


# -- hierarchical -------------------------------------------------------------------------------


class Hierarchical(_Segmented):
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
                _all_gather(every, node_block, group=topo.leader_group)
            else:
                every.copy_(node_block)
            for i, ranks in enumerate(topo.layout.nodes):
                for j, rank in enumerate(ranks):
                    start = (i * widest + j) * chunk
                    flat[rank * chunk:(rank + 1) * chunk].copy_(every[start:start + chunk])
        if len(topo.node_ranks) > 1:
            dist.broadcast(flat, src=leader, group=topo.local_group)
        return out


# -- automatic choice and the registry ------------------------------------------------------------


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
        _require_world(cls.name, group)
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


COLLECTIVES: dict[str, type[Collective]] = {
    "flat": Flat,
    "ring": Ring,
    "tree": Tree,
    "hierarchical": Hierarchical,
    "auto": Auto,
}


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


def _require_world(name: str, group: dist.ProcessGroup | None) -> None:
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(f"collective {name!r} runs on the whole default group only; use 'flat' on a subgroup")
