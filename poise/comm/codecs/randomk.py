"""Random-k sparsification (``randomk``): send k = ceil(ratio x n) entries at random indices.

The indices come from a generator seeded by (seed, key, call number), which every rank
computes identically, so only the k values travel (``k x 4`` bytes for fp32, half of
top-k's). Because all ranks pick the same indices, their value vectors can be added
element-wise: random-k is summable and goes through all-reduce. Indices are drawn with
replacement (a repeated index carries the same value twice and decodes once), which costs
O(k) instead of a permutation's O(n). Values are not rescaled by n/k: with error feedback
the unsent part is carried to later steps instead (Stich et al. 2018, "Sparsified SGD with
Memory"), which is how it should be used.

The call counter is per key and must advance identically on every rank: one encode per
bucket per step, as in DDP. It is part of :meth:`state_dict`.
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from typing import Any, ClassVar

import torch

from poise.comm.codecs.base import Codec, Encoded, check_ratio, flat, num_kept, output


class RandomKCodec(Codec):
    """``ratio`` of the entries at indices every rank derives from a shared seed."""

    name: ClassVar[str] = "randomk"
    summable: ClassVar[bool] = True
    lossy: ClassVar[bool] = True  # no checkpoint_delta: decoding needs the seed that drew the indices

    def __init__(self, ratio: float = 0.01, *, seed: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio(self.name, ratio)
        self.seed = seed
        self._calls: dict[Hashable, int] = {}

    def __repr__(self) -> str:
        return f"RandomKCodec(ratio={self.ratio}, seed={self.seed})"

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        src = flat(tensor).detach()
        n = src.numel()
        k = num_kept(n, self.ratio)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        # crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED)
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}:{call}".encode()))
        indices = torch.randint(n, (k,), generator=generator).to(src.device) if k else \
            torch.empty(0, dtype=torch.int64, device=src.device)
        values = self._buffers.get(key, "values", (k,), src.dtype, src.device)
        torch.index_select(src, 0, indices, out=values)
        return Encoded((values,), tensor.shape, tensor.dtype, context=indices)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return num_kept(numel, self.ratio) * dtype.itemsize

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        (values,) = encoded.tensors
        dst = output(out, encoded, values.device)
        dst.zero_()
        dst[encoded.context] = values.to(dst.dtype)
        return dst.view(encoded.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self._calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calls = dict(state["calls"])
