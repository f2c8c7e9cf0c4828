"""Reducers: move a codec's payloads between ranks and return the reduced gradient.

A reducer owns no compression math (codecs do) and knows nothing of DDP (``adapter.py`` does).
``reduce(tensor, key=..., weight=..., shapes=...)`` returns a future of ``sum_r w_r x_r`` over
the ranks of the group, where ``w_r`` is the ``weight`` rank r passed, or ``1 / world_size`` for
all if None (the mean, as DDP computes it). ``shapes`` are the shapes of the tensors the flat
``tensor`` is made of (a DDP bucket's parameters); only low rank uses them. Pre-weighting
happens before encoding, which also keeps fp16 payloads in range. The strategy follows from
the codec, never from a flag (:func:`make_reducer`):

1. :class:`AllReduceReducer`: summable payloads (casts, random-k, no compression) are summed
   by one all-reduce and decoded once.
2. :class:`AllGatherReducer`: other payloads (top-k, sign, int8) are packed into one byte
   buffer per rank, all-gathered, and each rank decodes and sums them locally.
3. :class:`LowRankReducer`: PowerSGD's two all-reduce rounds (P and the uncompressed
   entries, then Q), one low-rank block per weight matrix.

Every codec reducer moves its payloads through a :class:`~poise.comm.collectives.Collective`
(``collective=``; default :class:`~poise.comm.collectives.Flat`, the backend's own
all-reduce and all-gather on ``group``), so each codec runs over ring, tree or hierarchical
algorithms too. (:class:`LowRankReducer` keeps the backend's all-reduce.) Algorithms that
change *what* is reduced, such as compressing only between nodes or keeping a rank's own
unsent gradient, wrap any :class:`Reducer` (``wrappers.py``).

Threading: collectives are launched in the caller's thread, in call order (DDP calls a hook
per bucket in the same order on every rank), with ``async_op=True``. PowerSGD waits for round 1
in the caller's thread, never in a future callback. Callbacks only decode locally. torch's own
``powerSGD_hook`` launches round 2 from a callback, which hangs or crashes on gloo as soon as
there is more than one bucket.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Hashable

import torch
import torch.distributed as dist

from poise.comm.codecs import Codec, Encoded, ErrorFeedback
from poise.comm.codecs.base import Buffers
from poise.comm.codecs.cast import IdentityCodec
from poise.comm.codecs.lowrank import PowerSGDCodec, Shapes
from poise.comm.collectives import Collective, Flat
from poise.comm.state import Counters

Future = torch.futures.Future

_ALIGN_BYTES = 8  # each rank's packed payload is padded to this, so every part stays aligned


class Reducer(abc.ABC):
    """Sums pre-weighted tensors over the ranks of a group (the interface wrappers keep too)."""

    @abc.abstractmethod
    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        """Future of ``sum_r w_r tensor_r`` (see the module docstring), written into ``tensor``.

        Args:
            tensor: a flat, contiguous gradient; overwritten (scaled, then the result).
            key: identifies the tensor across calls (DDP's bucket index): per-key buffers,
                residuals and warm starts. Every rank must call with the same keys in the
                same order.
            weight: this rank's factor ``w_r``; None means ``1 / world_size`` on every rank.
            shapes: shapes of the tensors ``tensor`` is the concatenation of, if known.
        """


def prescale(tensor: torch.Tensor, weight: float | None, world_size: int) -> None:
    """Multiply ``tensor`` in place by ``weight``, or divide it by ``world_size`` if None."""
    if weight is None:
        tensor.div_(world_size)  # div_, not mul_(1/n): bit-identical to plain DDP
    else:
        tensor.mul_(weight)


class CodecReducer(Reducer):
    """A reduction strategy for one codec over one group.

    Args:
        codec: the codec (possibly wrapped in :class:`ErrorFeedback`).
        group: the process group (None: the default group).
        counters: where bytes and seconds are added (a private one if None).
        collective: the algorithm that moves the payloads (None: the backend's own on ``group``).
    """

    def __init__(self, codec: Codec, group: dist.ProcessGroup | None = None, counters: Counters | None = None,
                 collective: Collective | None = None) -> None:
        self.codec = codec
        self.group = group
        self.collective = collective if collective is not None else Flat(group)
        self.counters = counters if counters is not None else Counters()
        self._buffers = Buffers()

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def _prescale(self, tensor: torch.Tensor, weight: float | None) -> None:
        prescale(tensor, weight, self.world_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.codec!r} over {self.collective!r})"


class AllReduceReducer(CodecReducer):
    """Summable codecs: one all-reduce of the single payload tensor, then one decode."""

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        assert self.codec.summable, self.codec
        self._prescale(tensor, weight)
        start = time.perf_counter()
        encoded = self.codec.encode(tensor, key=key)
        (payload,) = encoded.tensors
        self.counters.add(raw_bytes=_nbytes(tensor), wire_bytes=self.codec.nbytes(encoded),
                          encode_s=time.perf_counter() - start, buckets=1)
        summed = self.collective.all_reduce(payload)

        def decode(fut: Future[torch.Tensor]) -> torch.Tensor:
            fut.wait()  # re-raises a failed collective
            t0 = time.perf_counter()
            out = self.codec.decode(encoded, out=tensor)  # the payload now holds the sum
            self.counters.add(decode_s=time.perf_counter() - t0)
            return out

        return summed.then(decode)


class AllGatherReducer(CodecReducer):
    """Non-summable codecs: all-gather every rank's packed payload; decode and sum locally."""

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        self._prescale(tensor, weight)
        start = time.perf_counter()
        encoded = self.codec.encode(tensor, key=key)
        chunk = -(-self.codec.nbytes(encoded) // _ALIGN_BYTES) * _ALIGN_BYTES
        send = self._buffers.get(key, "send", (chunk,), torch.uint8, tensor.device)
        _pack(encoded.tensors, send)
        recv = self._buffers.get(key, "recv", (chunk * self.world_size,), torch.uint8, tensor.device)
        self.counters.add(raw_bytes=_nbytes(tensor), wire_bytes=chunk, encode_s=time.perf_counter() - start, buckets=1)
        gathered = self.collective.all_gather(recv, send)

        def decode(fut: Future[torch.Tensor]) -> torch.Tensor:
            fut.wait()
            t0 = time.perf_counter()
            ranks = [_unpack(encoded, recv[r * chunk: (r + 1) * chunk]) for r in range(self.world_size)]
            out = self.codec.decode_sum(ranks, out=tensor)
            self.counters.add(decode_s=time.perf_counter() - t0)
            return out

        return gathered.then(decode)


class LowRankReducer(CodecReducer):
    """PowerSGD: all-reduce [P = M Q | dense], orthonormalize, all-reduce Q = M^T P, decode P Q^T.

    One block per weight matrix of the bucket (``shapes``); entries not worth compressing ride
    along uncompressed in round 1. Round 1 is waited for here, in the caller's thread: DDP
    calls hooks bucket by bucket in the same order on every rank, so this cannot deadlock, and
    no collective is ever started from a callback. With error feedback, a rank's residual is
    ``corrected - P Q_r^T`` on the blocks (the part of its own gradient that the shared basis P
    did not capture, Vogels et al. 2019) and zero on the dense entries, which are sent exactly.
    Buckets with nothing worth compressing are all-reduced uncompressed.
    """

    def __init__(self, codec: Codec, group: dist.ProcessGroup | None = None, counters: Counters | None = None) -> None:
        super().__init__(codec, group, counters)
        self.ef = codec if isinstance(codec, ErrorFeedback) else None
        inner = codec.codec if isinstance(codec, ErrorFeedback) else codec
        assert isinstance(inner, PowerSGDCodec), codec
        self.lowrank: PowerSGDCodec = inner
        self._uncompressed = AllReduceReducer(IdentityCodec(), group, self.counters)

    def reduce(self, tensor: torch.Tensor, *, key: Hashable, weight: float | None = None,
               shapes: Shapes | None = None) -> Future[torch.Tensor]:
        layout = self.lowrank.layout(tensor.numel(), shapes)
        if not layout.blocks:
            return self._uncompressed.reduce(tensor, key=key, weight=weight)
        self._prescale(tensor, weight)
        start = time.perf_counter()
        # with error feedback, the residual's buffer holds the corrected gradient until
        # ``subtract`` turns it into the new residual, in place
        corrected = self.ef.correct_in_place(tensor, key) if self.ef is not None else tensor
        if corrected is None:  # a NaN/Inf gradient in "skip" mode: make every rank see NaN
            corrected = tensor.fill_(float("nan"))
        # round 1 carries P and the dense entries together: one collective, not two
        round1 = self._buffers.get(key, "round1", (layout.p_numel + layout.dense_numel,), torch.float32,
                                   tensor.device)
        p, dense = round1[: layout.p_numel], round1[layout.p_numel:]
        self.lowrank.project_p(corrected, layout, key, p)
        layout.gather_dense(corrected, dense)
        encode_s = time.perf_counter() - start
        dist.all_reduce(round1, group=self.group)  # waited for here (see the class docstring)
        start = time.perf_counter()
        self.lowrank.orthonormalize(p, layout)
        q = self.lowrank.project_q(corrected, p, layout, key)
        if self.ef is not None and corrected is not tensor:
            self.lowrank.subtract(layout, p, q, corrected)  # residual = corrected - P Q_r^T
        self.counters.add(raw_bytes=_nbytes(tensor), wire_bytes=layout.wire_numel * 4, buckets=1,
                          encode_s=encode_s + time.perf_counter() - start)
        work = dist.all_reduce(q, group=self.group, async_op=True)

        def decode(fut: Future[list[torch.Tensor]]) -> torch.Tensor:
            fut.wait()
            t0 = time.perf_counter()
            self.lowrank.remember(key, q)  # the summed Q: equal on all ranks, next warm start
            out = self.lowrank.expand(layout, p, q, tensor, dense)
            self.counters.add(decode_s=time.perf_counter() - t0)
            return out

        return work.get_future().then(decode)


def make_reducer(codec: Codec, group: dist.ProcessGroup | None = None, counters: Counters | None = None,
                 collective: Collective | None = None) -> CodecReducer:
    """The reducer a codec needs: low-rank for PowerSGD, all-reduce if summable, else all-gather.

    ``collective`` moves the payloads of the all-reduce and all-gather paths (None: flat).
    """
    inner = codec.codec if isinstance(codec, ErrorFeedback) else codec
    if isinstance(inner, PowerSGDCodec):
        return LowRankReducer(codec, group, counters)
    if codec.summable:
        return AllReduceReducer(codec, group, counters, collective)
    return AllGatherReducer(codec, group, counters, collective)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack(tensors: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    """Copy the payload tensors' bytes back to back into the uint8 buffer ``out``."""
    offset = 0
    for t in tensors:
        assert offset % t.element_size() == 0, "codec payloads must come largest element first"
        n = _nbytes(t)
        out[offset: offset + n].copy_(t.reshape(-1).view(torch.uint8))
        offset += n


def _unpack(template: Encoded, packed: torch.Tensor) -> Encoded:
    """Views into ``packed`` with the layout of ``template``'s payload tensors."""
    parts, offset = [], 0
    for t in template.tensors:
        n = _nbytes(t)
        parts.append(packed[offset: offset + n].view(t.dtype).view(t.shape))
        offset += n
    return template.with_tensors(parts)
