"""Reducer wrappers: algorithms that change what a reduction computes, around any reducer.

Each wrapper is a :class:`~poise.comm.reducers.Reducer` itself (``reduce(tensor, key=,
weight=, shapes=)``), so they stack: the hook adapter calls the outermost one, and the
innermost is the codec's own strategy (``reducers.make_reducer``) over a collective that only
moves bytes. :func:`compose` builds the stack a configuration asks for:

- :class:`HierarchicalReducer`: sum inside each node uncompressed, reduce the node sums
  between the nodes' leaders through any reducer (a codec and its error feedback live at the
  leaders), broadcast the result inside each node.
- :class:`LocalFirst`: each rank adds back the part of its own gradient that its payload did
  not carry (error feedback then delays only the other ranks' parts).
- :class:`OnCommThread`: the whole reduction, waits included, on a communication thread, so
  DDP's autograd thread never waits for a collective (PowerSGD's two rounds).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch
import torch.distributed as dist

from poise.comm.codecs import Codec, ErrorFeedback
from poise.comm.codecs.cast import IdentityCodec
from poise.comm.codecs.lowrank import PowerSGDCodec, Shapes
from poise.comm.collectives import Collective, CommThread, NodePhases
from poise.comm.reducers import CodecReducer, LowRankReducer, Reducer, make_reducer, prescale
from poise.comm.state import Counters
from poise.comm.topology import private_group

log = logging.getLogger(__name__)

Future = torch.futures.Future


class HierarchicalReducer(Reducer):
    """Sum inside the node, reduce between nodes through ``inter_node`` at the leaders, broadcast.

    The whole tensor goes through each phase at once (a codec's choices, such as top-k's, are
    over the whole bucket), in one job on the topology's communication thread, which also
    waits for ``inter_node``'s future (never a callback; see ``collectives/threaded.py``). The result
    is ``sum over nodes of decode(encode(node sum))`` for a summable codec, the codec applied
    to each node's sum for the others.

    Args:
        hierarchical: the node phases, the topology and its thread.
        inter_node: on leaders, a reducer over ``hierarchical.topology.leader_group`` (its
            counters are the inter-node bytes); None on the other ranks. It must be there on
            every leader when there are several nodes.
        group: the whole group, for the mean (``1 / world_size``); None: the default group.
        counters: this rank's gradient bytes, counted once per bucket as sent uncompressed
            (inside the node, they are).
    """

    def __init__(self, hierarchical: NodePhases, inter_node: Reducer | None,
                 group: dist.ProcessGroup | None = None, counters: Counters | None = None) -> None:
        topology = hierarchical.topology
        if topology.is_leader and topology.layout.num_nodes > 1 and inter_node is None:
            raise ValueError("a hierarchical reduction needs the inter-node reducer on every leader")
        self.hierarchical = hierarchical
        self.inter_node = inter_node if topology.is_leader else None
        self.group = group
        self.counters = counters if counters is not None else Counters()

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        prescale(tensor, weight, dist.get_world_size(self.group))
        nbytes = tensor.numel() * tensor.element_size()
        self.counters.add(raw_bytes=nbytes, wire_bytes=nbytes, buckets=1)
        thread = self.hierarchical.topology.thread
        return thread.submit(lambda: self._reduce(tensor.view(-1), key, shapes), tensor.device)

    def _reduce(self, tensor: torch.Tensor, key: Hashable, shapes: Shapes | None) -> torch.Tensor:
        """The three phases; runs on the communication thread."""
        if tensor.numel() == 0:
            return tensor
        self.hierarchical.reduce_in_node(tensor)
        if self.inter_node is not None and self.hierarchical.topology.layout.num_nodes > 1:
            # the weights were applied before the node sum: the leaders add node sums as they are
            self.inter_node.reduce(tensor, key=key, weight=1.0, shapes=shapes).wait()
        self.hierarchical.broadcast_in_node(tensor)
        return tensor

    def __repr__(self) -> str:
        return f"HierarchicalReducer({self.hierarchical!r}, inter_node={self.inter_node!r})"


class LocalFirst(Reducer):
    """Each rank applies its own gradient whole, plus what the other ranks' payloads carried.

    Instead of ``sum of all payloads``, rank r gets ``sum of all payloads + (g_r - s_r)``: the
    part of its own (weighted) gradient that its payload ``s_r`` did not carry. Error feedback
    then delays only what the *other* ranks send, and nothing of a rank's own gradient. Why:
    with a sparsifier and error feedback, an entry waits until it has piled up (at 1 %, about
    once per hundred steps), and that delay, not the codec's error, is what cost top-k and
    random-k on the transformer (poise/train/optim.py). The residual's change over the call is
    exactly that unsent part: with ``c = g + e_old`` sent as ``s`` and ``e_new = c - s``,
    ``g - s = e_new - e_old``, so no extra byte is sent. The price: ranks no longer hold the
    same weights. Two ranks differ by the difference of their outstanding residuals, which is
    bounded as the residuals are; a resume starts every rank from rank 0's saved weights.

    Args:
        inner: a codec reducer whose codec is an :class:`~poise.comm.ErrorFeedback`, over a
            flat, ring or tree collective (the residual must be updated in the caller's
            thread, before ``reduce`` returns; a hierarchical reduction updates it later, at
            the leaders only).

    Raises:
        ValueError: ``inner`` is not such a reducer.
    """

    def __init__(self, inner: Reducer) -> None:
        if not isinstance(inner, CodecReducer) or not isinstance(inner.codec, ErrorFeedback):
            raise ValueError("local_first needs a codec with error feedback and a flat, ring or tree collective")
        self.inner = inner
        self.error_feedback: ErrorFeedback = inner.codec
        self._unsent: dict[Hashable, torch.Tensor] = {}  # per key, this call's residual change

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        unsent = self._unsent.get(key)  # unsent := e_old (zero before the first residual), reused
        if unsent is None or unsent.numel() != tensor.numel():
            unsent = self._unsent[key] = torch.empty_like(tensor.view(-1))
        before = self.error_feedback.residual(key)
        if before is None or before.shape != unsent.shape:
            unsent.zero_()
        else:
            unsent.copy_(before)
        fut = self.inner.reduce(tensor, key=key, weight=weight, shapes=shapes)
        after = self.error_feedback.residual(key)
        if after is None:  # the tensor went uncompressed (PowerSGD with no matrix in it)
            return fut
        torch.sub(after, unsent, out=unsent)  # e_new - e_old (the future reads it before the
        # next call with this key: DDP waits for every future at the end of backward)

        def add_unsent(done: Future[torch.Tensor]) -> torch.Tensor:
            out = done.value()
            out.view(-1).add_(unsent)
            return out

        return fut.then(add_unsent)

    def __repr__(self) -> str:
        return f"LocalFirst({self.inner!r})"


class OnCommThread(Reducer):
    """Run ``inner``'s whole reduction on a communication thread; the caller only enqueues.

    Why: PowerSGD cannot compute Q before its first round has been summed over the ranks, so
    in DDP's hook (the autograd thread) it holds backward up at every bucket for a round trip
    and for the factor products, and each bucket's wait also waits for the slowest rank to
    reach that bucket. On the thread, backward goes on with the next buckets while earlier
    ones are factorised and reduced. ``inner`` must issue its collectives only on process
    groups that no other thread uses (:func:`~poise.comm.topology.private_group`): the thread
    runs jobs in call order, which DDP makes the same on every rank, so the groups see their
    operations in the same order everywhere (``collectives/threaded.py`` gives the full argument).

    Args:
        inner: the reducer to run; its future is waited for on the thread.
        thread: the thread (one per process group, shared by the buckets).
    """

    def __init__(self, inner: Reducer, thread: CommThread) -> None:
        self.inner = inner
        self.thread = thread

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        def job() -> torch.Tensor:
            return self.inner.reduce(tensor, key=key, weight=weight, shapes=shapes).wait()

        return self.thread.submit(job, tensor.device)

    def __repr__(self) -> str:
        return f"OnCommThread({self.inner!r})"


def compose(codec: Codec, group: dist.ProcessGroup | None, collective: Collective | None, counters: Counters,
            inter_node_counters: Counters, *, local_first: bool = False) -> Reducer:
    """The reducer stack for ``codec`` over ``collective`` (None: flat): outermost first,
    [:class:`LocalFirst`] → [:class:`HierarchicalReducer`] → ``make_reducer(codec)``.

    PowerSGD outside a hierarchical reduction runs :class:`OnCommThread` over a private copy
    of ``group`` (created here: every rank of ``group`` must call at the same point), except
    under ``local_first``, which needs the residual before ``reduce`` returns.

    A collective that sums inside nodes first (``as_hierarchical()``) with a codec other than
    ``none`` compresses only between nodes: the codec's reducer runs on the leader group and
    counts into ``inter_node_counters``. Creates no process group (the topology has them).

    Raises:
        ValueError: ``local_first`` without error feedback, or over a hierarchical reduction.
    """
    hierarchical = collective.as_hierarchical() if collective is not None else None
    reducer: Reducer
    inner = codec.codec if isinstance(codec, ErrorFeedback) else codec
    if hierarchical is None and isinstance(inner, PowerSGDCodec) and not local_first:
        reducer = OnCommThread(LowRankReducer(codec, private_group(group), counters), CommThread("poise-powersgd"))
    elif hierarchical is None or isinstance(codec, IdentityCodec):
        reducer = make_reducer(codec, group, counters, collective)
    else:
        topology = hierarchical.topology
        if topology.layout.num_nodes == 1:
            log.warning("comm.codec=%s has no effect: hierarchical reduction compresses only between nodes, "
                        "and this job runs on one node", codec.name)
        inter = make_reducer(codec, topology.leader_group, inter_node_counters) if topology.is_leader else None
        reducer = HierarchicalReducer(hierarchical, inter, group, counters)
    return LocalFirst(reducer) if local_first else reducer
