"""Where the ranks are and how topology-aware collectives talk: the node layout, the process
groups built on it, and the one communication thread that runs the multi-step algorithms.

Split from ``collectives/`` (the algorithms), whose ``threaded.py`` explains why one FIFO thread
on process groups of its own is safe with gloo and NCCL.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

Future = torch.futures.Future


# -- the communication thread -----------------------------------------------------------------


class CommThread:
    """One daemon thread running collective jobs in FIFO order (see the module docstring).

    ``submit(fn, device)`` returns a future completed with ``fn()``'s result, or with its
    exception (the thread then goes on with the next job: peers that failed the same way
    fail their own futures).
    """

    def __init__(self, name: str = "poise-comm") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], torch.Tensor], device: torch.device) -> Future[torch.Tensor]:
        fut: Future[torch.Tensor] = Future()
        ready = None
        if device.type == "cuda":
            # the caller's kernels that produce the input may still be running on its stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._jobs.put((fn, fut, (device, ready)))
        return fut

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut, (device, ready) = job
            try:
                if ready is not None:
                    with torch.cuda.device(device):
                        torch.cuda.current_stream(device).wait_event(ready)
                        result = fn()
                        torch.cuda.current_stream(device).synchronize()  # CPU/GPU sync: the sum exists
                else:
                    result = fn()
            except BaseException as exc:  # handed to whoever waits on the future
                fut.set_exception(exc)
                continue
            fut.set_result(result)

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued jobs, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout_s)


def private_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A new process group with ``group``'s ranks (None: the world), for one thread's use alone.

    Only ``group``'s ranks take part in creating it (``use_local_synchronization``), each at
    the same point; it takes the default group's timeout (``dist.timeout_s``).
    """
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, timeout=default_group_timeout(), use_local_synchronization=True)


# -- topology ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLayout:
    """Which global ranks share a node.

    Attributes:
        nodes: per node (ordered by node id), its global ranks ordered by local rank; the
            first of each is the node's leader.
    """

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks(cls, node_and_local: list[tuple[int, int]]) -> NodeLayout:
        """Layout from every rank's ``(node id, local rank)``, indexed by global rank.

        Raises:
            ValueError: two ranks of one node claim the same local rank.
        """
        by_node: dict[int, list[tuple[int, int]]] = {}
        for rank, (node, local) in enumerate(node_and_local):
            by_node.setdefault(node, []).append((local, rank))
        nodes = []
        for node in sorted(by_node):
            members = sorted(by_node[node])
            locals_ = [local for local, _ in members]
            if len(set(locals_)) != len(locals_):
                raise ValueError(f"node {node}: local ranks {locals_} repeat: GROUP_RANK/LOCAL_RANK are inconsistent")
            nodes.append(tuple(rank for _, rank in members))
        return cls(tuple(nodes))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.nodes)

    @property
    def max_ranks_per_node(self) -> int:
        return max(len(ranks) for ranks in self.nodes)

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)


def spans_nodes(ranks: Sequence[int], ranks_per_node: int | None = None) -> bool:
    """Whether ``ranks`` are on more than one node, from torchrun's numbering (ranks node after
    node, ``ranks_per_node`` per node, by default ``LOCAL_WORLD_SIZE``; without either, one
    node). No collective: every strategy that counts inter-node bytes asks this one place."""
    per_node = ranks_per_node if ranks_per_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return per_node > 0 and len({r // per_node for r in ranks}) > 1


def default_group_timeout() -> timedelta | None:
    """The timeout the default process group was initialised with (``dist.timeout_s``), read from
    its backend's options; None when the backend does not expose it (new_group's default then)."""
    group = dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout  # type: ignore[union-attr]
        except (RuntimeError, AttributeError):
            continue
    return None


def _node_identity() -> tuple[int, int]:
    """This process's ``(node id, local rank)`` from torchrun's environment.

    ``GROUP_RANK`` is the node's rank in the job; without it (a script not started by
    torchrun), ranks on the same host share a node.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"]), local
    import socket
    import zlib

    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF, local


class Topology:
    """The node layout of the default group, its process groups and the communication thread.

    Created once per process, on every rank at the same point (it creates process groups,
    which every rank must do in the same order): ``Topology.discover()``. Owns:

    - ``world_group``: a private copy of the world, for ring and tree;
    - ``local_group``: this rank's node; ``leader_group``: one leader per node (None on
      other ranks);
    - ``thread``: the :class:`CommThread` every collective built on it shares, so their
      operations are queued in one call order.
    """

    def __init__(self, layout: NodeLayout) -> None:
        world = dist.get_world_size()
        self.layout = layout
        self.rank = dist.get_rank()
        self.world_size = world
        # new_group's own default is 30 minutes (gloo), not the default group's dist.timeout_s:
        # a dead peer would hang ring, tree and hierarchical that long
        timeout = default_group_timeout()
        self.world_group = dist.new_group(list(range(world)), timeout=timeout)
        self.local_group = None
        for ranks in layout.nodes:  # every rank creates every node's group, in the same order
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self.local_group = group
        leader_group = dist.new_group(list(layout.leaders), timeout=timeout)
        self.is_leader = self.rank in layout.leaders
        self.leader_group = leader_group if self.is_leader else None
        self.node_ranks = layout.nodes[layout.node_of(self.rank)]
        self.thread = CommThread()
        log.info("topology: %d nodes %s", layout.num_nodes, [list(n) for n in layout.nodes])

    @classmethod
    def discover(cls) -> Topology:
        """Gather every rank's ``(GROUP_RANK, LOCAL_RANK)`` over the default group and build."""
        if not dist.is_initialized():
            raise ValueError("collectives other than 'flat' need an initialised default process group")
        mine = _node_identity()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return cls(NodeLayout.from_ranks([tuple(x) for x in everyone]))

    def close(self) -> None:
        self.thread.close()
