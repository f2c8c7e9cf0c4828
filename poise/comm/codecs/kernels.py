"""Fused single-pass CPU kernels (numba) for the int8, sign and top-k codecs, and whether they are on.

Why: encode+decode of a large float32 gradient is bound by memory bandwidth, not arithmetic.
The numpy/torch paths in ``int8.py``, ``sign.py`` and ``topk.py`` chain whole-block operations
(max, min, multiply, add, copy; compare, pack, sum; abs, compare, nonzero, take), each one
more trip through the caches and some through memory. These kernels read each entry from
memory once and write each output entry once:

- int8 encode: per chunk (4 KiB at ``chunk_size=1024``, in L1) an integer max over the float
  bits for max |x|, then from L1 the quantization straight into the int8 payload; decode:
  ``float32(q) * scale`` in one pass.
- sign encode: per 8 KiB sub-block, the sum of |x| (float64), then from L1 16 signs per vector
  compare, stored as two payload bytes; decode: one vector blend of ``±scale`` per 16 entries.
- top-k candidate scan: one vector compare of |x| per 16 entries; the few groups with a
  candidate are walked bit by bit.

The 16-wide compares and blends are LLVM vector intrinsics written with numba's
``@intrinsic`` (numba's loops would gather or go scalar there); on AVX-512 each is one
instruction into or out of a mask register. Payloads and decodes are the fallbacks' bit for
bit, except sign's L1 norm, summed in float64 here in vector order (sasum sums in float32):
its scale may differ in the last bits.

The kernels compile on first use, all at once: about 2 s (2 cores) the first time on a
machine; ``cache=True`` keeps the machine code on disk (``__pycache__``), and later processes
load it in about 1.3 s, mostly numba's own start-up. They release the GIL (``nogil=True``), and the wrappers share a
tensor out over torch's threads with :func:`poise.comm.codecs.base.parallel_blocks`; numba's
threading layer is not used, so it never competes with torch's OpenMP pool. numba is optional
(poise's ``kernels`` extra; ``make venv`` installs it): without it, or with ``POISE_NUMBA=0``,
``AVAILABLE`` is False and the codecs take their numpy/torch paths, which :func:`enabled` logs
once per process.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
from typing import Any

import numpy as np

from poise.comm.codecs.base import parallel_blocks

# The codecs read this at call time (tests switch it off); POISE_NUMBA=0 turns the kernels off.
# numba itself is imported on first use (:func:`warm`), so importing the codecs stays cheap.
AVAILABLE: bool = importlib.util.find_spec("numba") is not None and os.environ.get("POISE_NUMBA", "1") != "0"

# Entries per thread span below which one thread does it all: a pool hand-off (~50 µs) would
# cost more than it saves. 1 << 18 fp32 entries = 1 MiB.
MIN_SPAN = 1 << 18

_ABS_BITS = np.uint32(0x7FFFFFFF)  # float32 bits without the sign
_INF_BITS = np.uint32(0x7F800000)  # float32 bits of +inf; abs bits above it are NaN
# 1.5 x 2**23: adding it to a float32 v in [-127, 127] rounds v to an integer, half to even,
# exactly as int8.py's torch path does; the difference from the constant is that integer.
_MAGIC = np.float32(12582912.0)
_ONE = np.float32(1.0)
_Q_MAX = np.float32(127.0)

log = logging.getLogger(__name__)

_warm_lock = threading.Lock()
_warm = False
_said = False  # whether enabled() has logged the path taken (once per process)
# numba's intrinsics the kernels call, set by warm() (the kernels only run compiled)
_negative_mask16: Any = None
_store_signed16: Any = None
_at_least_mask16: Any = None
trailing_zeros: Any = None


def _int8_encode(xbits, x, scale_bits, scales, q, chunk, c_lo, c_hi):  # pragma: no cover - compiled
    """Chunks ``[c_lo, c_hi)`` of ``x``: scales ``max|x| / 127`` and int8 ``round(x / scale)``.

    ``xbits`` and ``scale_bits`` are uint32 views of ``x`` and ``scales``. Per chunk, one pass
    takes max |x| as the maximum of the float bits with the sign cleared (an integer max, which
    vectorizes; NaN bits sort above inf, so a NaN wins as torch's amax does), and a second pass
    over the same chunk, now in L1, quantizes: ``factor = (1 / peak) * 127`` (torch's
    ``127.0 / peak``), ``q = round(x * factor)`` in float32, half to even. Indices are unsigned
    so that numba adds no negative-index wraparound, which would stop LLVM vectorizing.
    """
    n = np.uint64(x.size)
    width = np.uint64(chunk)
    for c in range(np.uint64(c_lo), np.uint64(c_hi)):
        lo = c * width
        hi = min(lo + width, n)
        peak = np.uint32(0)
        for i in range(lo, hi):
            peak = max(peak, np.uint32(xbits[i] & _ABS_BITS))
        scale_bits[c] = peak
        p = scales[c]  # max |x| as a float
        scales[c] = p / _Q_MAX
        if peak == 0 or peak >= _INF_BITS:
            # all zero: every entry is 0. NaN/inf: factor 0 turns finite entries into 0 and
            # NaN/inf into NaN, whose bits' low byte the torch path sends: 0. The scale (NaN or
            # inf) makes the whole chunk decode to NaN, so the error check downstream sees it.
            for i in range(lo, hi):
                q[i] = 0
        else:
            factor = (_ONE / p) * _Q_MAX
            for i in range(lo, hi):
                # MAGIC + round(v) is an integer below 2**24: its low byte is round(v) as int8
                q[i] = np.int32(x[i] * factor + _MAGIC)


def _int8_decode(scales, q, out, chunk, c_lo, c_hi):  # pragma: no cover - compiled
    """Chunks ``[c_lo, c_hi)``: ``out = float32(q) * scale``, each entry written once."""
    n = np.uint64(out.size)
    width = np.uint64(chunk)
    for c in range(np.uint64(c_lo), np.uint64(c_hi)):
        lo = c * width
        hi = min(lo + width, n)
        s = scales[c]
        for i in range(lo, hi):
            out[i] = np.float32(q[i]) * s


def _define_intrinsics() -> dict[str, Any]:
    """The LLVM vector intrinsics the kernels call, built once numba is imported."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    f16 = ir.VectorType(ir.FloatType(), 16)

    def _contiguous_float32(arr) -> bool:
        """Whether a numba type is a C-contiguous float32 array: what the intrinsics read."""
        return isinstance(arr, types.Array) and arr.layout == "C" and arr.dtype == types.float32

    @intrinsic
    def _negative_mask16(typingctx, arr, start):  # pragma: no cover - compiled
        """Bit j of the uint16 result: ``arr[start + j] < 0`` for j < 16 (np.packbits' little bit
        order, two packed bytes). One vector compare into a mask register where the CPU has
        them (AVX-512: vcmpps + kmovw); numba's own loops would gather or go scalar here."""
        if not _contiguous_float32(arr):
            return None
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            vector = builder.load(builder.bitcast(builder.gep(data, [args[1]]), f16.as_pointer()), align=4)
            negative = builder.fcmp_ordered("<", vector, ir.Constant(f16, [0.0] * 16))
            return builder.bitcast(negative, ir.IntType(16))
        return types.uint16(arr, start), codegen

    @intrinsic
    def _store_signed16(typingctx, arr, start, mask, positive, negative):  # pragma: no cover - compiled
        """``arr[start + j] = negative`` where bit j of the uint16 ``mask`` is set, else ``positive``,
        for j < 16: one vector blend and one 64-byte store."""
        if not _contiguous_float32(arr):
            return None
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            bits = builder.bitcast(args[2], ir.VectorType(ir.IntType(1), 16))
            undef = ir.Constant(f16, ir.Undefined)
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16)
            first = ir.Constant(ir.IntType(32), 0)
            pos = builder.shuffle_vector(builder.insert_element(undef, args[3], first), undef, zeros)
            neg = builder.shuffle_vector(builder.insert_element(undef, args[4], first), undef, zeros)
            target = builder.bitcast(builder.gep(data, [args[1]]), f16.as_pointer())
            builder.store(builder.select(bits, neg, pos), target, align=4)
            return context.get_dummy_value()
        return types.void(arr, start, types.uint16, types.float32, types.float32), codegen

    @intrinsic
    def _at_least_mask16(typingctx, arr, start, threshold):  # pragma: no cover - compiled
        """Bit j of the uint16 result: ``|arr[start + j]| >= threshold`` for j < 16 (False for
        NaN, as numpy's ``greater_equal``); one vector abs and compare."""
        if not _contiguous_float32(arr):
            return None
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            vector = builder.load(builder.bitcast(builder.gep(data, [args[1]]), f16.as_pointer()), align=4)
            fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f16, [f16]), "llvm.fabs.v16f32")
            undef = ir.Constant(f16, ir.Undefined)
            zeros = ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16)
            bound = builder.shuffle_vector(builder.insert_element(undef, args[2], ir.Constant(ir.IntType(32), 0)),
                                           undef, zeros)
            hits = builder.fcmp_ordered(">=", builder.call(fabs, [vector]), bound)
            return builder.bitcast(hits, ir.IntType(16))
        return types.uint16(arr, start, types.float32), codegen

    return {"_negative_mask16": _negative_mask16, "_store_signed16": _store_signed16,
            "_at_least_mask16": _at_least_mask16}



_SUB = 2048  # entries per sub-block of sign encode: summed from memory, then packed from L1


def _sign_encode(x, packed16, g_lo, g_hi):  # pragma: no cover - compiled
    """Groups ``[g_lo, g_hi)`` of 16 entries: their sign bits into ``packed16`` (uint16 view of
    the payload) and their ``sum(|x|)`` in float64. Per sub-block of 2048 entries, one
    vectorized pass sums |x| (``reassoc``: the sum may be taken in any order; nothing else is
    relaxed, NaN and inf propagate) and a second, from L1, packs 16 signs per compare."""
    total = 0.0
    lo = np.uint64(g_lo) * np.uint64(16)
    end = np.uint64(g_hi) * np.uint64(16)
    while lo < end:
        hi = min(lo + np.uint64(_SUB), end)
        part = 0.0
        for i in range(lo, hi):
            part += abs(x[i])
        total += part
        for i in range(lo, hi, np.uint64(16)):
            packed16[i >> np.uint64(4)] = _negative_mask16(x, i)
        lo = hi
    return total


def _sign_encode_tail(x, packed, start):  # pragma: no cover - compiled
    """Entries from ``start`` (a multiple of 16) to the end: bytes of ``packed`` and sum(|x|)."""
    total = 0.0
    for b in range(start // 8, packed.size):
        byte = 0
        for i in range(8 * b, min(8 * b + 8, x.size)):
            v = x[i]
            byte |= (v < 0) << (i - 8 * b)
            total += abs(v)
        packed[b] = byte
    return total


def _sign_decode(packed16, scale, out, g_lo, g_hi):  # pragma: no cover - compiled
    """Groups ``[g_lo, g_hi)`` of 16 entries: ``out = -scale`` where the bit is set, else
    ``scale`` (``-scale`` flips the sign bit, as torch's ``-s`` in the fallback)."""
    negative = -scale
    for g in range(np.uint64(g_lo), np.uint64(g_hi)):
        _store_signed16(out, g * np.uint64(16), packed16[g], scale, negative)


def _sign_decode_tail(packed, scale, out, start):  # pragma: no cover - compiled
    """Entries from ``start`` (a multiple of 16) to the end."""
    negative = -scale
    for i in range(start, out.size):
        out[i] = negative if (packed[i >> 3] >> (i & 7)) & 1 else scale


def _sign_decode_sum(packed16, scales, out, g_lo, g_hi):  # pragma: no cover - compiled
    """Groups ``[g_lo, g_hi)`` of 16 entries: ``out = sum over ranks r of ±scales[r]`` from row
    r of ``packed16`` (ranks x groups, uint16), summed in rank order as a decode-then-add loop
    would. Block by block (:data:`_SUB` entries): each rank's block is decoded into an L1
    scratch with the vector store of :func:`_sign_decode`, then added, so the output travels
    to and from memory once in all instead of once per rank."""
    scratch = np.empty(_SUB, dtype=np.float32)
    lo = np.uint64(g_lo)
    end = np.uint64(g_hi)
    step = np.uint64(_SUB // 16)
    while lo < end:
        hi = min(lo + step, end)
        first = lo * np.uint64(16)
        n = (hi - lo) * np.uint64(16)
        for r in range(packed16.shape[0]):
            scale = scales[r]
            negative = -scale
            for g in range(lo, hi):
                _store_signed16(scratch, (g - lo) * np.uint64(16), packed16[r, g], scale, negative)
            if r == 0:
                for i in range(n):
                    out[first + i] = scratch[i]
            else:
                for i in range(n):
                    out[first + i] += scratch[i]
        lo = hi


def _sign_decode_sum_tail(packed, scales, out, start):  # pragma: no cover - compiled
    """Entries from ``start`` (a multiple of 16) to the end; ``packed`` is ranks x bytes."""
    for i in range(start, out.size):
        total = np.float32(0.0)
        for r in range(packed.shape[0]):
            total += -scales[r] if (packed[r, i >> 3] >> (i & 7)) & 1 else scales[r]
        out[i] = total


def _at_least(x, threshold, index, values, lo, hi):  # pragma: no cover - compiled
    """Entries ``i`` in ``[lo, hi)`` with ``|x[i]| >= threshold``: their indices into ``index``
    and values into ``values``, in ascending order; returns how many, or -1 where they do not
    fit. One vector compare per 16 entries; the rare groups with a hit are walked bit by bit."""
    count = 0
    capacity = index.size
    end16 = lo + (hi - lo) // 16 * 16
    for i in range(np.uint64(lo), np.uint64(end16), np.uint64(16)):
        mask = _at_least_mask16(x, i, threshold)
        while mask:
            if count == capacity:
                return -1
            j = i + np.uint64(trailing_zeros(mask))
            index[count] = j
            values[count] = x[j]
            count += 1
            mask &= mask - np.uint16(1)
    for j in range(end16, hi):
        if abs(x[j]) >= threshold:
            if count == capacity:
                return -1
            index[count] = j
            values[count] = x[j]
            count += 1
    return count


# the kernels above, and the numba options of each: all compiled on first use by warm()
_KERNELS = {
    "_int8_encode": {}, "_int8_decode": {}, "_sign_encode": {"fastmath": {"reassoc"}},
    "_sign_encode_tail": {}, "_sign_decode": {}, "_sign_decode_tail": {}, "_sign_decode_sum": {},
    "_sign_decode_sum_tail": {}, "_at_least": {},
}


def enabled() -> bool:
    """Whether the codecs should call these kernels: numba is there, not switched off, and the
    kernels are compiled (the first call compiles them: see :func:`warm`). The first call logs
    which path the CPU codecs take, once per process: a user whose environment lacks numba
    (an optional dependency, ``poise[kernels]``) learns why the codecs run slower."""
    global _said
    ready = AVAILABLE and (_warm or warm())
    if not _said:
        _said = True
        log.info("%s", describe(ready))
    return ready


def describe(ready: bool) -> str:
    """One line: the path the CPU codecs take (int8, sign, top-k) and why."""
    if ready:
        return "CPU codecs: numba's fused kernels (POISE_NUMBA=0 turns them off)"
    if os.environ.get("POISE_NUMBA", "1") == "0":
        return "CPU codecs: numpy/torch paths (POISE_NUMBA=0)"
    return ("CPU codecs: numpy/torch paths, numba is not installed (pip install numba, or poise's 'kernels' "
            "extra, for the fused kernels)")


def warm() -> bool:
    """Import numba and compile (or load from the on-disk cache) every kernel for float32,
    once per process: the module's plain functions are replaced by their compiled versions.
    Returns whether the kernels are ready (False where numba does not import).

    Called before the first parallel dispatch, so that two threads never wait on one compile.
    """
    global _warm, AVAILABLE
    if _warm or not AVAILABLE:
        return _warm
    with _warm_lock:
        if _warm:
            return True
        try:
            from numba import njit
            from numba.cpython.unsafe.numbers import trailing_zeros
        except ImportError:  # pragma: no cover - numba is found but does not import
            AVAILABLE = False
            return False
        names = globals()
        names.update(_define_intrinsics(), trailing_zeros=trailing_zeros)
        for name, options in _KERNELS.items():
            names[name] = njit(cache=True, nogil=True, **{"fastmath": False, **options})(names[name])
        x = np.array([0.5, -1.0, 0.0], dtype=np.float32)
        scales = np.zeros(2, dtype=np.float32)
        q = np.zeros(3, dtype=np.int8)
        _int8_encode(x.view(np.uint32), x, scales.view(np.uint32), scales, q, 2, 0, 2)
        _int8_decode(scales, q, np.empty(3, dtype=np.float32), 2, 0, 2)
        x = np.linspace(-1, 1, 19, dtype=np.float32)
        packed = np.zeros(3, dtype=np.uint8)
        _sign_encode(x, packed[:2].view(np.uint16), 0, 1)
        _sign_encode_tail(x, packed, 16)
        out = np.empty(19, dtype=np.float32)
        _sign_decode(packed[:2].view(np.uint16), np.float32(1), out, 0, 1)
        _sign_decode_tail(packed, np.float32(1), out, 16)
        rows = np.zeros((2, 4), dtype=np.uint8)
        _sign_decode_sum(rows[:, :2].copy().view(np.uint16), scales, out, 0, 1)
        _sign_decode_sum_tail(rows[:, :3].copy(), scales, out, 16)
        _at_least(x, np.float32(0.5), np.empty(19, dtype=np.int64), np.empty(19, dtype=np.float32), 0, 19)
        _warm = True
        return True


def int8_encode(x: np.ndarray, scales: np.ndarray, q: np.ndarray, chunk: int) -> None:
    """Quantize flat float32 ``x`` into ``q`` (int8, same length) with one scale per ``chunk``
    entries into ``scales`` (float32, ``ceil(len / chunk)``); nearest rounding, as int8.py."""
    warm()
    xbits, scale_bits = x.view(np.uint32), scales.view(np.uint32)
    _over_chunks(lambda lo, hi: _int8_encode(xbits, x, scale_bits, scales, q, chunk, lo, hi), scales.size, chunk)


def int8_decode(scales: np.ndarray, q: np.ndarray, out: np.ndarray, chunk: int) -> None:
    """``out[i] = float32(q[i]) * scales[i // chunk]`` into flat float32 ``out``."""
    warm()
    _over_chunks(lambda lo, hi: _int8_decode(scales, q, out, chunk, lo, hi), scales.size, chunk)


def sign_encode(x: np.ndarray, packed: np.ndarray) -> float:
    """Pack the signs of flat float32 ``x`` into ``packed`` (``ceil(len / 8)`` bytes, bit j of
    byte b set where ``x[8b + j] < 0``: np.packbits' little bit order) and return ``sum(|x|)``."""
    warm()
    groups = x.size // 16
    packed16 = packed[: 2 * groups].view(np.uint16)
    total = sum(_over_chunks(lambda lo, hi: _sign_encode(x, packed16, lo, hi), groups, 16))
    return total + _sign_encode_tail(x, packed, 16 * groups)


def sign_decode(packed: np.ndarray, scale: np.float32, out: np.ndarray) -> None:
    """``out[8b + j] = -scale`` where bit j of ``packed[b]`` is set, else ``scale`` (float32)."""
    warm()
    groups, scale = out.size // 16, np.float32(scale)
    packed16 = packed[: 2 * groups].view(np.uint16)
    _over_chunks(lambda lo, hi: _sign_decode(packed16, scale, out, lo, hi), groups, 16)
    _sign_decode_tail(packed, scale, out, 16 * groups)


def sign_decode_sum(packed: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """``out[8b + j] = sum over ranks r of (-scales[r] if bit j of packed[r, b] else scales[r])``:
    the sum of every rank's :func:`sign_decode`, in one pass. ``packed`` is C-contiguous, ranks
    x ``ceil(len / 8)`` bytes; ``scales`` float32, one per rank."""
    warm()
    groups = out.size // 16
    packed16 = packed[:, : 2 * groups].copy().view(np.uint16) if packed.shape[1] % 2 else packed.view(np.uint16)
    _over_chunks(lambda lo, hi: _sign_decode_sum(packed16, scales, out, lo, hi), groups, 16)
    _sign_decode_sum_tail(packed, scales, out, 16 * groups)


def entries_at_least(x: np.ndarray, threshold: float, capacity: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Ascending int64 indices ``i`` with ``|x[i]| >= threshold`` (compared in float32) and
    those ``x[i]``, in one pass over flat float32 ``x``; None where one thread's span holds more
    than ``capacity`` of them (the caller then takes its numpy scan)."""
    warm()
    bound = np.float32(threshold)

    def span(lo: int, hi: int) -> tuple[int, np.ndarray, np.ndarray]:
        index, values = np.empty(capacity, dtype=np.int64), np.empty(capacity, dtype=np.float32)
        return _at_least(x, bound, index, values, lo, hi), index, values

    parts = parallel_blocks(span, x.size, 1 << 16)
    if any(count < 0 for count, _, _ in parts):
        return None
    if len(parts) == 1:
        count, index, values = parts[0]
        return index[:count], values[:count]
    return (np.concatenate([i[:c] for c, i, _ in parts]), np.concatenate([v[:c] for c, _, v in parts]))


def _over_chunks(fn, count: int, width: int) -> list:
    """``fn(lo, hi)`` over ``range(count)`` (chunks of ``width`` entries), one span per torch
    thread, in spans of at least :data:`MIN_SPAN` entries (smaller work stays on this thread)."""
    return parallel_blocks(fn, count, max(1, MIN_SPAN // width))
