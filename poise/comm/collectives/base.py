"""The interface every collective algorithm implements, and :class:`Flat`, the backend's own."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from poise.comm.topology import Topology

Future = torch.futures.Future

# all_gather_single is the new name (torch >= 2.10); all_gather_into_tensor warns there.
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 64 << 10


class NodePhases(Protocol):
    """The node phases of a hierarchical reduction, for a reducer that puts its own inter-node
    step between them (``wrappers.HierarchicalReducer``; :class:`~poise.comm.collectives.Hierarchical`
    has them). Both block: call them on ``topology.thread`` only, in the same order on every rank."""

    topology: Topology

    def reduce_in_node(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over this node's ranks onto its leader."""

    def broadcast_in_node(self, tensor: torch.Tensor) -> None:
        """Copy the leader's ``tensor`` to every rank of its node."""


class Collective(abc.ABC):
    """A way to sum (and gather) tensors over a fixed group of ranks.

    Every rank must make the same calls in the same order, with tensors of the same size.
    """

    name: ClassVar[str]
    # May sum inside each node first (as_hierarchical): a codec over it then compresses only
    # between nodes, at the leaders, after all_reduce has returned; so no comm.local_first,
    # which needs the residual updated in the caller's thread (wrappers.LocalFirst).
    sums_in_nodes_first: ClassVar[bool] = False

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

    def as_hierarchical(self) -> NodePhases | None:
        """The hierarchical algorithm this collective sums every message with (hierarchical
        itself, or auto where its rule picks it for every size), or None; with one, a codec
        compresses only between nodes (``wrappers.compose``)."""
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
        work = all_gather_into_tensor(out, tensor, group=self.group, async_op=True)
        return work.get_future().then(_resolve_to(out))


def _resolve_to(result: torch.Tensor) -> Callable[[Future[Any]], torch.Tensor]:
    """A callback that re-raises a failed collective, else yields ``result`` (the backend's
    future holds a list of tensors; ours hold the tensor itself)."""

    def done(fut: Future[Any]) -> torch.Tensor:
        fut.wait()
        return result

    return done



def require_world(name: str, group: dist.ProcessGroup | None) -> None:
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(f"collective {name!r} runs on the whole default group only; use 'flat' on a subgroup")
