"""Error feedback: carry each bucket's compression error into the next step, for any codec.

Before encoding, the residual left over from the previous step is added to the gradient;
after encoding, the new residual is what the payload failed to represent:

    corrected = gradient + residual
    residual  = corrected - decode(encode(corrected))

Nothing is lost, only delayed, which is what lets biased compressors (sign, top-k, PowerSGD)
converge like uncompressed SGD. The idea is 1-bit SGD's (Seide et al. 2014); the analysis is
EF-SignSGD's (Karimireddy et al. 2019). :class:`ErrorFeedback` wraps any codec and keeps its
interface (the decorator design of BytePS's compressor core), holding one residual per key
(per DDP bucket).

A NaN or Inf in a gradient would enter the residual and poison every later step, so each
gradient is checked first (one read-only pass: its sum is finite unless an entry is not, or
the entries are so large that fp32 overflows). ``on_nonfinite="error"`` raises
:class:`NonFiniteGradientError`. ``"skip"`` leaves the residual as it was, logs a warning, and
encodes a payload of NaN instead, so the reduced gradient is NaN on *every* rank and every
rank can make the same decision to skip the optimizer step (as AMP's grad scaler does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from poise.comm.codecs.base import Codec, Encoded, flat

log = logging.getLogger(__name__)

ON_NONFINITE = ("error", "skip")


class NonFiniteGradientError(FloatingPointError):
    """A gradient handed to error feedback holds NaN or Inf."""


class ErrorFeedback(Codec):
    """Wrap ``codec`` so every key's compression error is added back on its next encode.

    Args:
        codec: any codec; its ``name``, ``summable`` and payloads are passed through.
        on_nonfinite: "error" (raise) or "skip" (keep the residual, send NaN); see the module
            docstring.
    """

    def __init__(self, codec: Codec, *, on_nonfinite: str = "error") -> None:
        super().__init__()
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is unknown: allowed are {', '.join(ON_NONFINITE)}")
        self.codec = codec
        self.on_nonfinite = on_nonfinite
        self.num_skipped = 0  # gradients skipped for NaN/Inf, since construction
        self._residuals: dict[Hashable, torch.Tensor] = {}

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.codec.name

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.codec.summable

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r}, on_nonfinite={self.on_nonfinite!r})"

    # -- the two halves, public for reducers whose payload is not decided by encode alone ----

    def correct(self, tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor | None:
        """``tensor + residual``, flat, in a per-key buffer; None if ``tensor`` is not finite
        and ``on_nonfinite`` is "skip".

        Raises:
            NonFiniteGradientError: on NaN/Inf with ``on_nonfinite="error"``.
        """
        src = flat(tensor)
        # float() is a device sync point on GPU; it is the price of a clean residual
        if src.numel() and not torch.isfinite(src.sum(dtype=torch.float32)):
            bad = int((~torch.isfinite(src)).sum())
            if self.on_nonfinite == "error":
                raise NonFiniteGradientError(
                    f"gradient for bucket {key} holds {bad} NaN/Inf entries of {src.numel()}: stopping "
                    "(set comm.on_nonfinite='skip' to skip such steps)")
            self.num_skipped += 1
            log.warning("gradient for bucket %s holds %d NaN/Inf entries: residual kept, step to be skipped",
                        key, bad)
            return None
        residual = self._residual_on(key, src.device)
        if residual is not None and residual.shape != src.shape:
            # DDP rebuilt its buckets (after step 1): old residuals belong to other entries
            log.info("bucket %s changed size (%d -> %d entries): residual dropped", key,
                     residual.numel(), src.numel())
            residual = None
        # a per-key buffer: a fresh gradient-sized allocation costs several copies (page faults)
        corrected = self._buffers.get(key, "corrected", src.shape, src.dtype, src.device)
        if residual is None:
            return corrected.copy_(src)
        return torch.add(src, residual, out=corrected)

    def correct_in_place(self, tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor | None:
        """``tensor + residual`` written into the residual's own buffer, which is returned (None
        as for :meth:`correct`). The caller must overwrite that buffer with the new residual
        before the next call with ``key``: a reducer that can compute ``corrected - sent`` in
        place (PowerSGD's ``M - P Q^T`` as one matrix product) saves a gradient-sized buffer and
        two passes over it."""
        src = flat(tensor)
        if src.numel() and not torch.isfinite(src.sum(dtype=torch.float32)):
            return self.correct(tensor, key)  # raises, or counts the skip and returns None
        residual = self._residual_on(key, src.device)
        if residual is None or residual.shape != src.shape or residual.dtype != src.dtype:
            if residual is not None:
                log.info("bucket %s changed size (%d -> %d entries): residual dropped", key,
                         residual.numel(), src.numel())
            residual = self._residuals[key] = src.clone()
            return residual
        return residual.add_(src)

    def _residual_on(self, key: Hashable | None, device: torch.device) -> torch.Tensor | None:
        """The residual of ``key`` on ``device``: a checkpoint is loaded on the CPU, and a CUDA
        run's first step after a resume would add a CPU residual to a CUDA gradient."""
        residual = self._residuals.get(key)
        if residual is not None and residual.device != device:
            residual = self._residuals[key] = residual.to(device)
        return residual

    def residual(self, key: Hashable | None) -> torch.Tensor | None:
        """The residual stored for ``key`` (flat), or None."""
        return self._residuals.get(key)

    # -- the Codec interface --------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        corrected = self.correct(tensor, key)
        if corrected is None:
            return poisoned(self.codec, tensor, key)
        encoded = self.codec.encode(corrected.view(tensor.shape), key=key)  # shape-aware codecs see it
        residual = self._residuals.get(key)
        if residual is None or residual.shape != corrected.shape or residual.dtype != corrected.dtype:
            residual = self._residuals[key] = torch.empty_like(corrected)
        # decode into the residual's buffer, then turn it into corrected - decoded in place
        decoded = self.codec.decode(dataclasses.replace(encoded, shape=corrected.shape), out=residual)
        torch.sub(corrected, decoded, out=residual)
        return dataclasses.replace(encoded, shape=tensor.shape)

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.codec.decode(encoded, out=out)

    def decode_sum(self, encoded: Sequence[Encoded], *, out: torch.Tensor) -> torch.Tensor:
        return self.codec.decode_sum(encoded, out=out)

    def nbytes(self, encoded: Encoded) -> int:
        return self.codec.nbytes(encoded)

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.codec.encoded_nbytes(numel, dtype)

    def state_dict(self) -> dict[str, Any]:
        """Residuals (per key), the wrapped codec's state and the skip count, for checkpoints."""
        return {"residuals": {k: v.clone() for k, v in self._residuals.items()},
                "codec": self.codec.state_dict(), "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.codec.load_state_dict(state["codec"])
        self.num_skipped = int(state.get("num_skipped", 0))


def poisoned(codec: Codec, tensor: torch.Tensor, key: Hashable | None) -> Encoded:
    """A payload of ``codec``'s layout whose floating-point parts are NaN, so it decodes to
    (and sums to) NaN wherever it lands. Used to pass a skipped step on to every rank."""
    encoded = codec.encode(torch.zeros_like(tensor), key=key)
    for t in encoded.tensors:
        if t.is_floating_point():
            t.fill_(float("nan"))
    return encoded
