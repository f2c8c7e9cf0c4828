"""FSDP2's collectives with poise's codecs, byte counters and timing probe.

How it works. FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces each sharded module's
gradients in its post-backward: it copies them into one flat input whose ``n`` equal chunks
belong to the ``n`` ranks of the shard group, reduce-scatters it, [on native 2-D HSDP
all-reduces the result over the replicate group], calls the module's all-reduce hook, then
divides. torch 2.13 lets every step of that be replaced per module, and this module does so:

- :class:`ShardedReduceScatter` (``set_custom_reduce_scatter``) with a codec. Summable codecs
  (``fp16``, ``bf16``, ``randomk``) encode each destination's chunk, reduce-scatter the
  payloads and decode the rank's own sum, so the sum runs in the wire dtype (fp16 is divided
  by ``n`` before and multiplied back after, so the sum stays in fp16's range). The others
  (``int8``, ``topk``, ``sign``) encode each destination's chunk, exchange the encoded chunks
  with one all-to-all, and each rank decodes and sums the ``n`` payloads of its own chunk.
  With error feedback the residual is kept per module and destination chunk (the key
  ``"<module>/<chunk>"``). Low rank (PowerSGD) needs whole weight matrices, which a flat
  chunk is not: it runs on HSDP's replicate all-reduce instead.
- :class:`ReplicateAllReduce` (``set_all_reduce_hook``), for HSDP with poise's codec between
  nodes: the model is sharded on a 1-D shard mesh, so FSDP2 reduce-scatters inside the shard
  group, and this hook all-reduces each shard over the replicate group through any poise
  reducer (:func:`poise.comm.reducers.make_reducer`: casts, int8, top-k, PowerSGD, ...),
  error feedback per module's shard.
- :class:`CountingAllGather` (``set_custom_all_gather``) and :class:`NativeReplicateCounter`
  (the all-reduce hook of native 2-D HSDP) only count and time what FSDP2 sends anyway.

Every one adds to one :class:`ShardedComm`: the step's bytes (:class:`~poise.comm.state.Counters`,
read as :class:`~poise.comm.state.StepStats`), those of groups that span nodes apart, and the
timing probe. Bytes follow DDP's convention: what this rank hands to each collective (a
reduce-scatter's whole input, as a DDP bucket; an all-gather's own shard; raw = before the
codec, wire = after it). Parameter all-gathers are counted in both raw and wire (they are
sent uncompressed), so ``raw / wire`` is the compression of all of FSDP2's traffic.

Timing: on the CPU, FSDP2's collectives run synchronously in the training thread, so a rank
waiting for a slower one waits *inside* its forward and backward. :class:`BlockingProbe`
adds up those seconds and :meth:`BlockingProbe.close_backward` moves them after the rank's
own compute (the probe's ``last_ready`` is the end of backward minus every second blocked in
a collective since the step began), so the timeline's compute excludes waiting, as under DDP,
and the gradient reductions show as exposed communication (on the CPU none of it overlaps).
On CUDA the collectives run on FSDP2's own streams and the marks are events: the probe keeps
them as DDP's probe does (the last reduce-scatter's hand-over ends compute).
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from poise.comm.codecs import Codec, ErrorFeedback
from poise.comm.codecs.cast import Fp16Codec, IdentityCodec
from poise.comm.codecs.lowrank import PowerSGDCodec
from poise.comm.probe import BucketProbe
from poise.comm.reducers import _ALIGN_BYTES, Reducer, _pack, _unpack
from poise.comm.state import Counters, StepStats
from poise.runtime.clock import HostClock

# the *_single names are newer torch's (the older names warn there); torch 2.10, the lowest
# pyproject declares, has only the older ones, with the same arguments
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Shapes = list[tuple[int, ...]]


class BlockingProbe(BucketProbe):
    """A :class:`~poise.comm.probe.BucketProbe` that also adds up the seconds the training
    thread spent blocked in collectives (see the module doc).

    Attributes (besides :class:`BucketProbe`'s):
        blocked_s: host seconds inside collectives since :meth:`reset` (all-gathers included).
        reduce_s: the part of ``blocked_s`` spent reducing gradients.
    """

    def reset(self) -> None:
        super().reset()
        self.blocked_s = 0.0
        self.reduce_s = 0.0

    def blocked(self, seconds: float, *, gradient: bool) -> None:
        """Note ``seconds`` blocked in a collective (``gradient``: a gradient reduction)."""
        self.blocked_s += seconds
        if gradient:
            self.reduce_s += seconds

    def close_backward(self, backward_mark: Any) -> None:
        """After the step's backward (begun at ``backward_mark``): on the host clock, compute ends
        ``blocked_s`` before now (never before backward began) and the gradient reductions
        follow it back to back (nothing was hidden: they blocked the thread). Other clocks keep
        the marks the collectives left."""
        if not isinstance(self.clock, HostClock):
            return
        now = self.clock.mark()
        ready = max(backward_mark, now - self.blocked_s)
        self.last_ready = ready
        self.in_flight = [(ready, ready + self.reduce_s)] if self.reduce_s > 0 else []


class ShardedComm:
    """What every collective of one sharded model shares (see the module doc).

    Args:
        probe: the strategy's timing probe.
        start_step: optimizer steps reduced uncompressed first (``registry.compression_start``).
        node_of: the node id of every global rank (groups whose ranks are on several nodes
            count as inter-node traffic).
        before_reduce: called before each module's gradient reduction (an emulated slower
            device stretches the backward compute up to there).

    Attributes:
        counters, inter_node_counters: this step's bytes, all and between nodes.
        step: optimizer steps whose gradients were reduced (decides when compression starts).
        expected: gradient reductions are the step's (inside ``step.backward``); else refused.
    """

    def __init__(self, probe: BlockingProbe, *, start_step: int, node_of: Sequence[int],
                 before_reduce: Sequence[Callable[[], None]] = ()) -> None:
        self.probe = probe
        self.start_step = start_step
        self.node_of = list(node_of)
        self.before_reduce = list(before_reduce)
        self.counters, self.inter_node_counters = Counters(), Counters()
        self.step = 0
        self.expected = False
        self._spans: dict[tuple[int, ...], bool] = {}

    @property
    def compressing(self) -> bool:
        """Whether this step's reductions go through the codec (past the uncompressed warm-up)."""
        return self.step >= self.start_step

    def spans_nodes(self, group: dist.ProcessGroup) -> bool:
        """Whether ``group``'s ranks are on more than one node."""
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._spans:
            self._spans[ranks] = len({self.node_of[r] for r in ranks}) > 1
        return self._spans[ranks]

    def count(self, group: dist.ProcessGroup, *, raw_bytes: int, wire_bytes: int, encode_s: float = 0.0,
              decode_s: float = 0.0, buckets: int = 0) -> None:
        """Add one collective's bytes (and codec seconds) to the step's counters."""
        stats = {"raw_bytes": raw_bytes, "wire_bytes": wire_bytes, "encode_s": encode_s, "decode_s": decode_s,
                 "buckets": buckets}
        self.counters.add(**stats)
        if self.spans_nodes(group):
            self.inter_node_counters.add(**stats)

    def begin_reduce(self) -> None:
        """A gradient reduction is about to start: refuse it outside the step's backward (one
        line, raised out of ``backward()``), else let emulation stretch the compute first."""
        if not self.expected:
            raise ValueError("a gradient was reduced outside step.backward(loss): call step.backward(loss), "
                             "not loss.backward(), so the loss is weighted and timed (nothing was applied: stop "
                             "here and fix the loop)")
        for fn in self.before_reduce:
            fn()

    def reset_step(self) -> None:
        self.counters.reset()
        self.inter_node_counters.reset()
        self.probe.reset()

    def step_stats(self) -> StepStats:
        return self.counters.snapshot()

    def inter_node_stats(self) -> StepStats:
        return self.inter_node_counters.snapshot()


def node_identity() -> int:
    """This process's node id: torchrun's ``GROUP_RANK``, else its host name's hash."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _inner(codec: Codec) -> Codec:
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


def check_shard_codec(codec: type[Codec] | None) -> None:
    """Refuse (one-line ValueError) a codec class the reduce-scatter cannot run."""
    if codec is not None and issubclass(codec, PowerSGDCodec):
        raise ValueError("comm.codec='powersgd' needs whole weight matrices, which a reduce-scatter's flat "
                         "chunks are not: use int8, fp16, bf16 or topk on FSDP's reduce-scatter, or HSDP "
                         "(fully_shard on mesh['shard']) to run powersgd on the all-reduce between nodes")


class ShardedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one module's gradients (``set_custom_reduce_scatter``): plain,
    or through ``codec`` once compression has started (see the module doc).

    Args:
        comm: the shared counters, probe and step.
        codec: the codec (with :class:`~poise.comm.ErrorFeedback` if wanted); None or
            ``none``: the plain reduce-scatter.
        key: the module's name, keying its residuals and buffers (``"<key>/<chunk>"``).
    """

    def __init__(self, comm: ShardedComm, codec: Codec | None, key: str) -> None:
        self.comm = comm
        self.codec = None if codec is None or isinstance(_inner(codec), IdentityCodec) else codec
        if self.codec is not None:
            check_shard_codec(type(_inner(self.codec)))
        self.key = key
        self.ended: Any = None  # the probe's mark when the last call returned

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"poise's reduce-scatter sums ({op} was asked): keep "
                             "set_force_sum_reduction_for_comms(True), which poise.sync.Sharded sets")
        comm = self.comm
        comm.begin_reduce()
        started = comm.probe.on_bucket()
        t0 = time.perf_counter()
        if self.codec is None or not comm.compressing:
            _reduce_scatter_single(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            comm.count(group, raw_bytes=_nbytes(input_tensor), wire_bytes=_nbytes(input_tensor), buckets=1)
        elif self.codec.summable:
            self._summable(self.codec, output_tensor, input_tensor, group)
        else:
            self._all_to_all(self.codec, output_tensor, input_tensor, group)
        comm.probe.blocked(time.perf_counter() - t0, gradient=True)
        comm.probe.on_done(started)
        self.ended = comm.probe.clock.mark()
        return None  # done: FSDP2 calls without async_op

    def _encode_chunks(self, codec: Codec, input_tensor: torch.Tensor, n: int) -> list:
        chunks = input_tensor.view(n, -1)
        return [codec.encode(chunks[r], key=f"{self.key}/{r}") for r in range(n)]

    def _summable(self, codec: Codec, output: torch.Tensor, input_tensor: torch.Tensor,
                  group: dist.ProcessGroup) -> None:
        """Payloads summed by the reduce-scatter itself, in the wire dtype."""
        n, me = group.size(), group.rank()
        prescale = isinstance(_inner(codec), Fp16Codec)  # fp16's sum must stay below 65504
        start = time.perf_counter()
        if prescale:
            input_tensor.div_(n)  # FSDP2's own buffer, free to change (it divides it in place too)
        encoded = self._encode_chunks(codec, input_tensor, n)
        payloads = [e.tensors[0] for e in encoded]
        assert all(len(e.tensors) == 1 for e in encoded), codec
        send = torch.cat([p.reshape(-1) for p in payloads])
        recv = torch.empty_like(payloads[me].reshape(-1))
        encode_s = time.perf_counter() - start
        _reduce_scatter_single(recv, send, op=dist.ReduceOp.SUM, group=group)
        t0 = time.perf_counter()
        codec.decode(encoded[me].with_tensors([recv.view(payloads[me].shape)]), out=output)
        if prescale:
            output.mul_(n)
        self.comm.count(group, raw_bytes=_nbytes(input_tensor), wire_bytes=_nbytes(send), encode_s=encode_s,
                        decode_s=time.perf_counter() - t0, buckets=1)

    def _all_to_all(self, codec: Codec, output: torch.Tensor, input_tensor: torch.Tensor,
                    group: dist.ProcessGroup) -> None:
        """Each destination's encoded chunk sent to it (one all-to-all); decoded and summed there."""
        n, me = group.size(), group.rank()
        start = time.perf_counter()
        encoded = self._encode_chunks(codec, input_tensor, n)
        chunk = -(-max(codec.nbytes(e) for e in encoded) // _ALIGN_BYTES) * _ALIGN_BYTES
        send = torch.zeros(n * chunk, dtype=torch.uint8, device=input_tensor.device)
        for r, e in enumerate(encoded):
            _pack(e.tensors, send[r * chunk: (r + 1) * chunk])
        recv = torch.empty_like(send)
        encode_s = time.perf_counter() - start
        dist.all_to_all_single(recv, send, group=group)
        t0 = time.perf_counter()
        mine = encoded[me]
        codec.decode_sum([_unpack(mine, recv[r * chunk: (r + 1) * chunk]) for r in range(n)], out=output)
        self.comm.count(group, raw_bytes=_nbytes(input_tensor), wire_bytes=_nbytes(send), encode_s=encode_s,
                        decode_s=time.perf_counter() - t0, buckets=1)


class CountingAllGather(AllGather):
    """FSDP2's parameter all-gather (``set_custom_all_gather``), unchanged, counted and timed."""

    def __init__(self, comm: ShardedComm) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        t0 = time.perf_counter()
        work = _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        if not async_op:
            self.comm.probe.blocked(time.perf_counter() - t0, gradient=False)
        self.comm.count(group, raw_bytes=_nbytes(input_tensor), wire_bytes=_nbytes(input_tensor))
        return work


class NativeReplicateCounter:
    """The all-reduce hook of native 2-D HSDP: counts the all-reduce FSDP2 just ran over
    ``group`` (the replicate dimension) and its seconds (from the reduce-scatter's end)."""

    def __init__(self, comm: ShardedComm, group: dist.ProcessGroup, reduce_scatter: ShardedReduceScatter) -> None:
        self.comm, self.group, self.reduce_scatter = comm, group, reduce_scatter

    def __call__(self, reduce_output: torch.Tensor) -> None:
        comm, started = self.comm, self.reduce_scatter.ended
        comm.count(self.group, raw_bytes=_nbytes(reduce_output), wire_bytes=_nbytes(reduce_output), buckets=1)
        if started is not None and isinstance(comm.probe.clock, HostClock):
            comm.probe.blocked(comm.probe.clock.mark() - started, gradient=True)
        self.reduce_scatter.ended = None


class ReplicateAllReduce:
    """HSDP's all-reduce between nodes through a poise reducer, as FSDP2's all-reduce hook on a
    model sharded on the shard sub-mesh (see the module doc): the mean over ``group`` of the
    shard group's sum, written back in place (FSDP2 then divides by the shard size).

    Args:
        comm: the shared counters, probe and step.
        reducer: the codec's reducer over ``group`` (error feedback per ``key``).
        uncompressed: the plain reducer over ``group``, for the warm-up steps.
        counters: the counters both reducers add to (their bytes join the step's here).
        group: the replicate process group.
        key: the module's name (its residual, warm start and buffers).
        shapes: the module's gradient shards' shapes, in FSDP2's order (PowerSGD compresses
            each matrix on its own); None: one flat block.
        first: whether this hook is the module's first reduction (no reduce-scatter runs
            before it when the shard group has one rank): it refuses and stretches then.
    """

    def __init__(self, comm: ShardedComm, reducer: Reducer, uncompressed: Reducer, counters: Counters,
                 group: dist.ProcessGroup, key: str, shapes: Shapes | None, *, first: bool) -> None:
        self.comm, self.reducer, self.uncompressed, self.counters = comm, reducer, uncompressed, counters
        self.group, self.key, self.shapes, self.first = group, key, shapes, first

    def __call__(self, reduce_output: torch.Tensor) -> None:
        comm = self.comm
        if self.first:
            comm.begin_reduce()
        started = comm.probe.on_bucket()
        t0 = time.perf_counter()
        before = self.counters.snapshot()
        reducer = self.reducer if comm.compressing else self.uncompressed
        result = reducer.reduce(reduce_output, key=self.key, weight=None, shapes=self.shapes).wait()
        if result.data_ptr() != reduce_output.data_ptr():
            reduce_output.copy_(result.reshape(-1))
        after = self.counters.snapshot()
        if comm.spans_nodes(self.group):
            comm.inter_node_counters.add(raw_bytes=after.raw_bytes - before.raw_bytes,
                                         wire_bytes=after.wire_bytes - before.wire_bytes)
        comm.probe.blocked(time.perf_counter() - t0, gradient=True)
        comm.probe.on_done(started)


def plus(a: StepStats, b: StepStats) -> StepStats:
    """The sum of two counters' readings."""
    return StepStats(a.raw_bytes + b.raw_bytes, a.wire_bytes + b.wire_bytes, a.encode_s + b.encode_s,
                     a.decode_s + b.decode_s, a.buckets + b.buckets)


__all__ = ["BlockingProbe", "CountingAllGather", "NativeReplicateCounter", "ReplicateAllReduce", "ShardedComm",
           "ShardedReduceScatter", "check_shard_codec", "node_identity", "plus"]
