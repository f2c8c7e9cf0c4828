"""What every gradient codec is: the :class:`Codec` interface and the :class:`Encoded` payload.

A codec turns a flat gradient into a few payload tensors and back. It never talks to a process
group: reducers (``poise/comm/reducers.py``) move the payloads, so a codec can be tested and
benchmarked alone. Two properties decide how a reducer moves a codec's payloads:

- ``summable``: payloads from different ranks can be added element-wise and the sum decodes to
  the sum of the gradients (casts; random-k with indices shared through a seed). Those go
  through all-reduce. The others (top-k, sign, int8 with per-rank scales) are all-gathered and
  decoded and summed locally.
- low rank (PowerSGD) needs two rounds; see ``lowrank.py``.

Three more say how poise trains and checkpoints with a codec (``poise/comm/registry.py`` reads
them for every ``comm.codec`` name):

- ``lossy``: its error per step is of the order of the gradient itself (sparsifying, 1-bit
  and low-rank codecs), so compression starts after a longer uncompressed warm-up
  (``registry.compression_start``): error-feedback residuals as large as the gradients hurt
  most early in training, while the learning rate ramps up and gradients change fastest.
- ``freezes_variance``: its payload gives every entry the same magnitude, so Adam's second
  moment would measure the codec's scale instead of the gradient: ``comm.freeze_variance=auto``
  freezes it when compression starts (``poise/train/optim.py`` has the measurements; sparse
  and low-rank codecs train better with it live).
- ``checkpoint_delta``: offered as ``checkpoint.delta_codec``, to write a tensor's change
  between checkpoints: its payload decodes alone, with no state or shared seed (random-k and
  PowerSGD need them).

Speed: a fresh 100 MB allocation costs several times a copy into an existing buffer (the pages
must be faulted in), so callers on a hot path pass a ``key`` and the codec reuses that key's
output buffers from one call to the next (DDP's bucket index is such a key).
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class Encoded:
    """A codec's output: the tensors sent on the wire plus what is needed to undo them.

    Attributes:
        tensors: the payload, in wire order, ordered by descending element size so that a
            reducer can pack them back to back into one byte buffer without padding.
        shape: shape of the encoded tensor.
        dtype: dtype of the encoded tensor (decode returns this dtype).
        context: data every rank derives identically and that is therefore never sent
            (random-k's indices, from the shared seed). None for most codecs.
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    context: Any = None

    @property
    def numel(self) -> int:
        """Number of entries of the encoded tensor."""
        return self.shape.numel()

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Encoded:
        """The same encoding with other payload tensors (e.g. another rank's, or their sum)."""
        return Encoded(tuple(tensors), self.shape, self.dtype, self.context)


class Buffers:
    """Reusable tensors, one per (key, slot); with ``key=None`` every request is a fresh tensor.

    A buffer handed out for a key is overwritten by the next request for the same key and
    slot, so a payload stays valid until the next ``encode`` with that key.
    """

    def __init__(self) -> None:
        self._store: dict[tuple[Hashable, str], torch.Tensor] = {}

    def get(self, key: Hashable | None, slot: str, shape: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        if key is None:
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        buf = self._store.get((key, slot))
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._store[(key, slot)] = buf
        return buf


class Codec(abc.ABC):
    """Encode a tensor into payload tensors and decode them back (no process group, ever).

    Subclasses set ``name`` and ``summable`` (and ``lossy``, ``freezes_variance``,
    ``checkpoint_delta`` where they hold; see the module doc) and implement ``encode`` and
    ``decode``.
    """

    name: ClassVar[str]
    summable: ClassVar[bool]
    lossy: ClassVar[bool] = False
    freezes_variance: ClassVar[bool] = False
    checkpoint_delta: ClassVar[bool] = False

    def __init__(self) -> None:
        self._buffers = Buffers()

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        """Encode ``tensor`` (any shape; read as flat).

        Args:
            tensor: the gradient. It is not modified.
            key: reuse this key's buffers (valid until the next encode with the same key);
                None allocates fresh ones. Stateful codecs (PowerSGD warm start, random-k's
                per-key seed sequence) also keep their state per key.
        """

    @abc.abstractmethod
    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rebuild a tensor of ``encoded.shape`` and ``encoded.dtype``, into ``out`` if given."""

    def nbytes(self, encoded: Encoded) -> int:
        """Bytes this payload puts on the wire (the payload tensors, nothing else)."""
        return sum(t.numel() * t.element_size() for t in encoded.tensors)

    @abc.abstractmethod
    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes on the wire for a flat tensor of ``numel`` entries of ``dtype``, without encoding
        it (equal to ``nbytes(encode(t))``; for cost models and the simulator)."""

    def decode_sum(self, encoded: Sequence[Encoded], *, out: torch.Tensor) -> torch.Tensor:
        """Sum of the decodes of several ranks' payloads, written into ``out``.

        Codecs override this when a fused form is cheaper (top-k: one scatter-add).
        """
        if not encoded:
            return out.zero_()
        self.decode(encoded[0], out=out)
        # one scratch per thread (callbacks of different buckets may run at once), reused: a
        # fresh gradient-sized tensor per call costs several times the decode (page faults)
        scratch = self._buffers.get(("decode_sum", threading.get_ident()), "scratch", out.shape, out.dtype,
                                    out.device)
        for enc in encoded[1:]:
            out.add_(self.decode(enc, out=scratch))
        return out

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (warm-start factors, seed counters); empty for stateless codecs."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ValueError(f"codec {self.name!r} keeps no state, but was given {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a contiguous 1-D view (a copy only if it was not contiguous)."""
    return tensor.reshape(-1)


def output(out: torch.Tensor | None, encoded: Encoded, device: torch.device) -> torch.Tensor:
    """``out`` checked against ``encoded``, or a new tensor of its shape and dtype, flat."""
    if out is None:
        return torch.empty(encoded.numel, dtype=encoded.dtype, device=device)
    assert out.numel() == encoded.numel and out.dtype == encoded.dtype, (out.shape, out.dtype, encoded.shape)
    assert out.is_contiguous()
    return out.view(-1)


def check_ratio(codec: str, ratio: float) -> float:
    """``ratio`` if it is in (0, 1]; a one-line ValueError otherwise."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{codec}: ratio={ratio} is outside (0, 1]")
    return float(ratio)


def num_kept(numel: int, ratio: float) -> int:
    """Entries kept by a sparsifier: ceil(ratio × numel), at least 1 for a non-empty tensor."""
    if numel == 0:
        return 0
    # round first: 0.01 * 300 is 3.0000000000000004 in binary floating point
    return min(numel, max(1, math.ceil(round(ratio * numel, 6))))


def parallel_blocks(fn: Callable[[int, int], T], size: int, block: int) -> list[T]:
    """``[fn(lo, hi), ...]`` over ``range(size)`` cut into one whole-block span per torch thread.

    For numpy kernels, which run on one core (they release the GIL, so threads do overlap);
    torch ops already use every core. The first span runs on the calling thread.
    """
    workers = max(1, torch.get_num_threads())
    per_worker = max(block, -(-size // (workers * block)) * block)
    spans = [(lo, min(lo + per_worker, size)) for lo in range(0, size, per_worker)]
    if len(spans) <= 1:
        return [fn(0, size)]
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="poise-codec")
    futures = [_pool.submit(fn, lo, hi) for lo, hi in spans[1:]]
    return [fn(*spans[0]), *(f.result() for f in futures)]
