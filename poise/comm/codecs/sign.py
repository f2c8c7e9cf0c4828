"""1-bit sign compression with a mean-magnitude scale (``sign``).

Each entry is sent as its sign, packed 8 per byte, plus one fp32 scale for the whole tensor:
the mean magnitude ``||x||_1 / n``. Decoding gives ``±scale``. This is the scaled-sign
compressor of EF-SignSGD (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes"), descended from 1-bit SGD (Seide et al. 2014); it is biased, so
use it with error feedback. Payloads from different ranks carry different scales and cannot be
summed as they are: they are all-gathered.

Wire size: ``ceil(n / 8) + 4`` bytes (32x smaller than fp32).

Speed, on CPU float32 (the path DDP buckets take): numpy's ``packbits`` packs a bool block
faster than a copy, while shift-and-or in torch runs at a fifth of copy speed, so the signs go
through numpy in cache-sized blocks, and the L1 norm of each block is taken while it is in
cache, with BLAS ``sasum`` when scipy is there (torch's ``vector_norm(x, 1)`` over the whole
tensor costs about three times as much). Decoding
looks each byte up in a 256 x 8 table of ``±scale``. Other devices and dtypes use plain torch
ops (slower, same result).

With numba (``kernels.py``), CPU float32 takes fused kernels instead: encode packs the bits
and sums |x| (in float64) in one pass over memory; decode writes each entry once from its bit.
The payload bits are the same; the scale may differ from sasum's float32 sum in the last bits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar

import numpy as np
import torch

from poise.comm.codecs import kernels
from poise.comm.codecs.base import Codec, Encoded, flat, output, parallel_blocks

# Entries per block of the CPU loops: a multiple of 8 (whole bytes); 256 KiB of fp32 stays in L2.
_BLOCK = 1 << 16
# _BITS[b, j] is bit j (least significant first) of byte b: the table the decoder indexes.
_BITS = torch.tensor(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"),
                     dtype=torch.bool)
_SHIFTS = torch.arange(8, dtype=torch.uint8)
# Rows of 8 entries per index_select call when decoding (8 MiB of output): measured fastest here.
_DECODE_ROWS = 1 << 18


@functools.cache
def _sasum() -> Callable[[np.ndarray], float] | None:
    """scipy's BLAS sasum, looked up at the first encode, not at import: importing scipy takes
    about 0.5 s (2 cores) in every process that imports the codecs, and most never encode signs.
    scipy comes with scikit-learn (poise's tasks extra); without it the L1 norm takes numpy's path."""
    try:
        from scipy.linalg.blas import sasum
    except ImportError:  # pragma: no cover
        return None
    return sasum


def _block_l1(x: np.ndarray) -> float:
    """``sum(|x|)`` of a float32 block in one read-only pass (BLAS sasum where scipy is there)."""
    sasum = _sasum()
    if sasum is not None:
        return float(sasum(x))
    return float(np.abs(x).sum(dtype=np.float64))


class SignCodec(Codec):
    """Signs packed 8 per byte (little-endian bit order; set bit = negative) and one scale."""

    name: ClassVar[str] = "sign"
    summable: ClassVar[bool] = False
    lossy: ClassVar[bool] = True
    freezes_variance: ClassVar[bool] = True  # every entry is sent as +-scale: one magnitude for all

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        src = flat(tensor).detach()
        n = src.numel()
        scale = self._buffers.get(key, "scale", (1,), torch.float32, src.device)
        packed = self._buffers.get(key, "packed", ((n + 7) // 8,), torch.uint8, src.device)
        if n == 0:
            scale.zero_()
        else:
            if src.device.type == "cpu" and src.dtype == torch.float32 and kernels.enabled():
                l1 = kernels.sign_encode(src.numpy(), packed.numpy())
            elif src.device.type == "cpu" and src.dtype == torch.float32:
                l1 = _pack_signs_numpy(src.numpy(), packed.numpy())
            else:
                _pack_signs_torch(src, packed)
                l1 = float(torch.linalg.vector_norm(src, 1))  # on GPU: a sync point
            scale.fill_(l1 / n)
        # wire order: larger elements first, so packing the two back to back needs no padding
        return Encoded((scale, packed), tensor.shape, tensor.dtype)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 + (numel + 7) // 8

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        scale, packed = encoded.tensors
        dst = output(out, encoded, packed.device)
        n = encoded.numel
        if n == 0:
            return dst.view(encoded.shape)
        if (dst.device.type == "cpu" and dst.dtype == torch.float32 and packed.device.type == "cpu"
                and packed.is_contiguous() and kernels.enabled()):
            kernels.sign_decode(packed.numpy(), scale.numpy()[0], dst.numpy())
            return dst.view(encoded.shape)
        s = scale.to(dst.dtype)
        table = torch.where(_BITS.to(packed.device), -s, s)  # 256 x 8: each byte's 8 values
        full = n // 8
        rows = dst[: full * 8].view(full, 8)
        index = torch.empty(min(full, _DECODE_ROWS), dtype=torch.int32, device=packed.device)
        for start in range(0, full, _DECODE_ROWS):
            stop = min(start + _DECODE_ROWS, full)
            idx = index[: stop - start]
            idx.copy_(packed[start:stop])  # index_select wants int32/int64 indices
            torch.index_select(table, 0, idx, out=rows[start:stop])
        if n % 8:
            dst[full * 8:] = table[int(packed[full])][: n % 8]
        return dst.view(encoded.shape)


    def decode_sum(self, encoded: Sequence[Encoded], *, out: torch.Tensor) -> torch.Tensor:
        """Sum of every payload's decode. On CPU float32 with numba, one fused pass: each output
        entry is written once (decoding rank by rank and adding reads and writes the whole
        gradient once per rank; with 4 ranks of 77 MB that is ~10x slower)."""
        if (not encoded or not encoded[0].numel or out.device.type != "cpu" or out.dtype != torch.float32
                or not out.is_contiguous() or not kernels.enabled()):
            return super().decode_sum(encoded, out=out)
        packed = np.stack([e.tensors[1].numpy() for e in encoded])  # ranks x bytes: 1/32 of the data
        scales = np.array([float(e.tensors[0][0]) for e in encoded], dtype=np.float32)
        kernels.sign_decode_sum(packed, scales, out.view(-1).numpy())
        return out.view(encoded[0].shape)


def _pack_signs_numpy(x: np.ndarray, packed: np.ndarray) -> float:
    """Write the sign bits of ``x`` into ``packed`` and return ``sum(|x|)``.

    Block by block, so that each block is read from memory once and its mask stays in cache;
    the blocks are shared out over the cores.
    """
    return sum(parallel_blocks(lambda lo, hi: _pack_span(x, packed, lo, hi), x.size, _BLOCK))


def _pack_span(x: np.ndarray, packed: np.ndarray, lo: int, hi: int) -> float:
    mask = np.empty(min(_BLOCK, hi - lo), dtype=bool)
    l1 = 0.0
    for start in range(lo, hi, _BLOCK):
        stop = min(start + _BLOCK, hi)
        block, m = x[start:stop], mask[: stop - start]
        np.less(block, 0, out=m)
        packed[start // 8: (stop + 7) // 8] = np.packbits(m, bitorder="little")
        l1 += _block_l1(block)
    return l1


def _pack_signs_torch(x: torch.Tensor, packed: torch.Tensor) -> None:
    """Device-agnostic packing: the same bits as the numpy path, with torch ops."""
    n = x.numel()
    bits = torch.zeros(packed.numel() * 8, dtype=torch.uint8, device=x.device)
    bits[:n] = x < 0
    weights = torch.bitwise_left_shift(torch.ones(8, dtype=torch.uint8, device=x.device), _SHIFTS.to(x.device))
    packed.copy_((bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8))
