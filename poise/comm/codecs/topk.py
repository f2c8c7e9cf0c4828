"""Top-k sparsification (``topk``): send the k largest-magnitude entries and where they are.

k = ceil(ratio x n). The wire format spends 4 bytes per kept entry, so ratio 0.01 is 100x
smaller than fp32:

- values as fp16 after dividing by their largest magnitude (one fp32 scale per payload), so
  they can neither overflow nor lose more than fp16's 2**-11 relative precision; with error
  feedback the rounding is carried to the next step like any other compression error;
- indices as 16-bit offsets inside blocks of 65,536 entries, plus one int32 count of kept
  entries per block (n / 16,384 bytes: 0.15% of the payload at ratio 0.01). Plain int32
  indices would double the payload.

Top-k is biased (small entries are never sent), so use it with error feedback, which makes it
converge like the dense gradient (Lin et al. 2018, "Deep Gradient Compression", DGC; Stich et
al. 2018). Payloads have different indices on every rank and are all-gathered; the decoded sum
is one scatter-add of everyone's (index, value) pairs (one payload alone, whose indices are
distinct, is a plain indexed store: half the time of the scatter-add).

Two selection methods give the same entries:

- ``exact=True``: ``torch.topk`` over all n magnitudes. O(n log k); on 2 CPU cores it runs at
  about 1/60 of copy speed at ratio 0.01.
- the default, DGC's sampled threshold: estimate the magnitude of the k-th largest entry from
  a strided sample (65,536 entries), lowered by ``oversample`` so that slightly more than k
  entries pass; collect the entries at or above it in one blocked pass (numpy ``flatnonzero``
  on 1 MiB blocks, one thread per core: torch's ``nonzero`` costs two copies); then keep
  the exact top k of those candidates (a set ~n/80 in size) with an O(n/80) ``np.partition``
  for the k-th largest magnitude and one compare (``torch.topk`` there, plus the index_select
  round trips, cost ~2 ms more per 100 MB). Indices come out in ascending order, as the
  block counts need. With numba (``kernels.py``) the candidate scan is one fused pass
  instead: a 16-wide vector compare per 16 entries, and only the rare groups with a
  candidate are walked. When the estimate misses (fewer than k candidates) it falls back to
  the exact method, so the result is always the true top k (up to ties).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from typing import ClassVar

import numpy as np
import torch

from poise.comm.codecs import kernels
from poise.comm.codecs.base import Codec, Encoded, check_ratio, flat, num_kept, output, parallel_blocks

log = logging.getLogger(__name__)

_BLOCK = 1 << 18  # entries per block of the candidate scan (1 MiB of fp32): fewer calls than 1 << 16, ~15% faster
_MIN_FAST_NUMEL = 1 << 16  # below this the exact method is as fast
_SPAN = 1 << 16  # an index travels as (its block of 2**16 entries, its 16-bit offset in the block)


class TopKCodec(Codec):
    """The ``ratio`` share of entries with the largest magnitudes, as (values, indices)."""

    name: ClassVar[str] = "topk"
    summable: ClassVar[bool] = False
    lossy: ClassVar[bool] = True
    checkpoint_delta: ClassVar[bool] = True  # indices and values decode alone

    def __init__(self, ratio: float = 0.01, *, exact: bool = False, sample_numel: int = 65536,
                 oversample: float = 1.25) -> None:
        super().__init__()
        self.ratio = check_ratio(self.name, ratio)
        self.exact = exact
        self.sample_numel = sample_numel
        self.oversample = oversample

    def __repr__(self) -> str:
        return f"TopKCodec(ratio={self.ratio}, exact={self.exact})"

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        src = flat(tensor).detach()
        n = src.numel()
        k = num_kept(n, self.ratio)
        selected = self._buffers.get(key, "selected", (k,), src.dtype, src.device)
        indices = self._buffers.get(key, "indices", (k,), torch.int64, src.device)
        if k and not self._select_fast(src, k, selected, indices):
            chosen = self._select(src, k).sort().values
            indices.copy_(chosen)
            torch.index_select(src, 0, chosen, out=selected)
        scale = self._buffers.get(key, "scale", (1,), torch.float32, src.device)
        counts = self._buffers.get(key, "counts", (_num_spans(n),), torch.int32, src.device)
        values = self._buffers.get(key, "values", (k,), torch.float16, src.device)
        offsets = self._buffers.get(key, "offsets", (k,), torch.int16, src.device)
        peak = selected.abs().max().float() if k else torch.zeros((), device=src.device)
        scale.copy_(torch.where(peak > 0, peak, 1.0))
        torch.mul(selected, 1.0 / scale.to(selected.dtype), out=values)
        # indices are ascending, so each block's count is a difference of two search positions
        bounds = torch.arange(0, (counts.numel() + 1) * _SPAN, _SPAN, device=src.device)
        counts.copy_(torch.searchsorted(indices, bounds).diff())
        offsets.copy_(indices)  # int64 -> int16 keeps the low 16 bits (two's complement wrap)
        return Encoded((scale, counts, values, offsets), tensor.shape, tensor.dtype)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 + 4 * _num_spans(numel) + 4 * num_kept(numel, self.ratio)

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode_sum([encoded], out=output(out, encoded, encoded.tensors[0].device))

    def decode_sum(self, encoded: Sequence[Encoded], *, out: torch.Tensor) -> torch.Tensor:
        """Scatter-add every payload's values at its indices into a zeroed ``out``."""
        flat_out = out.view(-1)
        flat_out.zero_()
        if encoded and encoded[0].numel:
            pairs = [_indices_values(e, out.dtype) for e in encoded]
            indices = torch.cat([i for i, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
            values = torch.cat([v for _, v in pairs]) if len(pairs) > 1 else pairs[0][1]
            if len(pairs) == 1:  # one payload's indices are distinct: a plain store, twice as fast
                flat_out.index_put_((indices,), values)
            else:
                flat_out.index_add_(0, indices, values)
        return out.view(encoded[0].shape) if encoded else out

    def _select_fast(self, x: torch.Tensor, k: int, values: torch.Tensor, indices: torch.Tensor) -> bool:
        """The sampled-threshold path: write the k largest |x| (ascending index order) into
        ``values`` and ``indices`` and return True; False where it does not apply or the
        threshold estimate kept fewer than k entries (the caller then takes the exact path)."""
        n = x.numel()
        if (self.exact or n < _MIN_FAST_NUMEL or k * 4 > n or x.device.type != "cpu"
                or x.dtype != torch.float32):
            return False
        xn = x.numpy()
        threshold = self._estimate_threshold(x, k)
        found = None
        if kernels.enabled():  # room for twice the expected count; more sends it to numpy's scan
            found = kernels.entries_at_least(xn, threshold, int(2 * k * self.oversample) + 1024)
        candidates, vals = found if found is not None else _entries_at_least(xn, threshold)  # sorted
        if candidates.size < k:
            log.debug("top-k: threshold estimate kept %d < k=%d entries; exact pass", candidates.size, k)
            return False
        keep = _top_k_of(np.abs(vals), k)
        np.take(candidates, keep, out=indices.numpy())
        np.take(vals, keep, out=values.numpy())
        return True

    def _select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """int64 indices of the k largest |x| (order unspecified), by ``torch.topk`` over all n."""
        return torch.topk(x.abs(), k, sorted=False).indices

    def _estimate_threshold(self, x: torch.Tensor, k: int) -> float:
        """A magnitude that slightly more than k entries of |x| reach, from a strided sample."""
        n = x.numel()
        stride = max(1, n // self.sample_numel)
        sample = x[::stride].abs()
        m = sample.numel()
        rank = min(m, max(1, math.ceil(k / n * m * self.oversample)))
        return float(torch.topk(sample, rank, sorted=False).values.min())


def _num_spans(numel: int) -> int:
    return -(-numel // _SPAN)


def _indices_values(encoded: Encoded, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One payload's int64 indices and its values in ``dtype``, undoing the block coding."""
    scale, counts, values, offsets = encoded.tensors
    starts = torch.arange(0, counts.numel() * _SPAN, _SPAN, dtype=torch.int64, device=counts.device)
    indices = starts.repeat_interleave(counts.long(), output_size=offsets.numel())
    indices += offsets.long() & (_SPAN - 1)  # undo the int16 wrap: offsets are 0 .. 65535
    return indices, values.to(dtype).mul_(scale.to(dtype))


def _top_k_of(mags: np.ndarray, k: int) -> np.ndarray:
    """Ascending positions of the k largest of ``mags`` (k <= size): an O(size) introselect
    (``np.partition``) for the k-th largest value, then one compare; ``torch.topk`` on the
    ~1.25 k candidates costs a third more. Entries tied with the k-th value fill up to k."""
    if mags.size == k:
        return np.arange(k)
    kth = np.partition(mags, mags.size - k)[mags.size - k]
    keep = np.flatnonzero(mags >= kth)
    if keep.size > k:  # ties at the k-th value: all strictly larger ones, then ties in index order
        above = np.flatnonzero(mags > kth)
        tied = np.flatnonzero(mags == kth)[: k - above.size]
        keep = np.sort(np.concatenate([above, tied]))
    return keep


def _entries_at_least(x: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted int64 indices i with |x[i]| >= threshold, and those x[i]; blocks split over the cores.

    The values are gathered while their block is in cache: gathering them afterwards from the
    whole tensor costs a cache miss per entry (~3.5 ms per 100 MB at ratio 0.01).
    """
    parts = [p for ps in parallel_blocks(lambda lo, hi: _scan(x, threshold, lo, hi), x.size, _BLOCK) for p in ps]
    if not parts:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=x.dtype)
    return np.concatenate([i for i, _ in parts]), np.concatenate([v for _, v in parts])


def _scan(x: np.ndarray, threshold: float, start: int, stop: int) -> list[tuple[np.ndarray, np.ndarray]]:
    scratch = np.empty(min(_BLOCK, stop - start), dtype=x.dtype)
    mask = np.empty(scratch.size, dtype=bool)
    parts = []
    for lo in range(start, stop, _BLOCK):
        hi = min(lo + _BLOCK, stop)
        a, m, block = scratch[: hi - lo], mask[: hi - lo], x[lo:hi]
        np.abs(block, out=a)
        np.greater_equal(a, threshold, out=m)
        hits = np.flatnonzero(m)
        if hits.size:
            values = np.take(block, hits)
            hits += lo
            parts.append((hits, values))
    return parts
