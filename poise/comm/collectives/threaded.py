"""Ring and tree all-reduce over point-to-point sends, run on one communication thread.

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
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from poise.comm.collectives.base import DEFAULT_SEGMENT_BYTES, Collective, Future, require_world
from poise.comm.topology import Topology


def _spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous spans covering ``range(numel)``, sizes differing by at most one."""
    bounds = [i * numel // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


class ThreadedCollective(Collective):
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


class Segmented(ThreadedCollective):
    """A threaded collective that sends its messages in pipelined segments of ``segment_bytes``."""

    def __init__(self, topology: Topology, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        super().__init__(topology)
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes={segment_bytes} must be positive")
        self.segment_bytes = segment_bytes

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, topology: Callable[[], Topology], *, segment_bytes: int,
               small_bytes: int) -> Collective:
        require_world(cls.name, group)
        return cls(topology(), segment_bytes)


class Ring(Segmented):
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


class Tree(ThreadedCollective):
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
        require_world(cls.name, group)
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

