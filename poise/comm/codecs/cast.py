"""Casting codecs: ``none`` (the gradient itself), ``fp16`` and ``bf16``.

Casts are summable: fp16/bf16 payloads from every rank are added by the all-reduce itself and
the sum is cast back. The reducer scales each rank's gradient (by 1/world_size, or by the
rank's weight) *before* the cast, so the summed payload cannot overflow fp16's range (65504)
where the raw sum would (the reason torch's ``fp16_compress_hook`` divides first). bf16 has
fp32's range and 8 bits of mantissa; fp16 has 10 bits but overflows beyond 65504.

Cost: one read of the gradient and one write of half its size to encode; the reverse to decode.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import torch

from poise.comm.codecs.base import Codec, Encoded, flat, output


class IdentityCodec(Codec):
    """No compression: the payload *is* the input (no copy), so all-reduce runs in place.

    This is what plain DDP sends; it is the baseline and the uncompressed warm-up steps.
    """

    name: ClassVar[str] = "none"
    summable: ClassVar[bool] = True  # no checkpoint_delta: checkpoint.delta_codec='exact' writes tensors whole

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        return Encoded((flat(tensor),), tensor.shape, tensor.dtype)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * dtype.itemsize

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        (payload,) = encoded.tensors
        if out is None:
            return payload.clone().view(encoded.shape)
        if out.data_ptr() != payload.data_ptr():
            out.view(-1).copy_(payload)
        return out.view(encoded.shape)


class CastCodec(Codec):
    """Send the gradient in a 16-bit float type; decode casts back to the input's dtype."""

    summable: ClassVar[bool] = True

    def __init__(self, wire_dtype: torch.dtype) -> None:
        super().__init__()
        self.wire_dtype = wire_dtype

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        src = flat(tensor)
        payload = self._buffers.get(key, "payload", src.shape, self.wire_dtype, src.device)
        payload.copy_(src)  # cast while copying: one pass, no temporary
        return Encoded((payload,), tensor.shape, tensor.dtype)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * self.wire_dtype.itemsize

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        (payload,) = encoded.tensors
        dst = output(out, encoded, payload.device)
        dst.copy_(payload)
        return dst.view(encoded.shape)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.wire_dtype})"


class Fp16Codec(CastCodec):
    """IEEE half precision on the wire: 2 bytes per entry, range ±65504."""

    name: ClassVar[str] = "fp16"
    checkpoint_delta: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(torch.float16)


class Bf16Codec(CastCodec):
    """bfloat16 on the wire: 2 bytes per entry, fp32's range, 8 mantissa bits."""

    name: ClassVar[str] = "bf16"
    checkpoint_delta: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)
