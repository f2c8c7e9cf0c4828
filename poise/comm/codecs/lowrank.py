"""PowerSGD low-rank compression (``powersgd``): the factor math, no communication.

PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization") views the gradient as a matrix M (rows x cols) and sends two thin
factors instead: P = M Q (rows x r), orthonormalized, then Q = M^T P (cols x r), so that
M ~ P Q^T. One step of subspace iteration per training step is enough because Q is kept from
the previous step (warm start) and error feedback carries what the approximation missed.

Every step is linear in M, so a reducer sums P over ranks, orthonormalizes the sum, computes
each rank's Q from it and sums those: two all-reduce rounds of (rows + cols) x r numbers
(``reducers.LowRankReducer``). Alone, :meth:`PowerSGDCodec.encode` runs the same steps on one
rank and the payload is (P, Q).

A DDP bucket is a flat vector of many parameters; it is laid out as the most nearly square
matrix that holds it (zero-padded), as torch's batched PowerSGD does. That loses the
per-layer structure but works for any bucket layout. A bucket too small to gain,
``(rows + cols) x r >= n``, is not worth compressing (:meth:`compresses`).

Cost: two (rows x cols) x r matrix products to encode, one to decode; QR of a rows x r matrix.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable
from typing import Any, ClassVar

import torch

from poise.comm.codecs.base import Codec, Encoded, flat, output


class PowerSGDCodec(Codec):
    """Rank-``rank`` approximation of the gradient laid out as a near-square matrix."""

    name: ClassVar[str] = "powersgd"
    summable: ClassVar[bool] = False

    def __init__(self, rank: int = 4, *, warm_start: bool = True, seed: int = 0) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"powersgd: rank={rank} must be positive")
        self.rank = int(rank)
        self.warm_start = warm_start
        self.seed = seed
        self._q: dict[Hashable, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"PowerSGDCodec(rank={self.rank}, warm_start={self.warm_start})"

    # -- the steps, in the order a reducer calls them ------------------------------------------

    @staticmethod
    def matrix_shape(numel: int) -> tuple[int, int]:
        """(rows, cols) of the most nearly square matrix holding ``numel`` entries."""
        cols = max(1, math.ceil(math.sqrt(numel)))
        return max(1, -(-numel // cols)), cols

    def effective_rank(self, numel: int) -> int:
        rows, cols = self.matrix_shape(numel)
        return min(self.rank, rows, cols)

    def compresses(self, numel: int) -> bool:
        """Whether the two factors are smaller than the tensor itself."""
        rows, cols = self.matrix_shape(numel)
        return (rows + cols) * self.effective_rank(numel) < numel

    def as_matrix(self, tensor: torch.Tensor, key: Hashable | None) -> torch.Tensor:
        """``tensor`` as the (rows x cols) float32 matrix M: a view when it fits exactly."""
        src = flat(tensor).detach()
        rows, cols = self.matrix_shape(src.numel())
        if rows * cols == src.numel() and src.dtype == torch.float32:
            return src.view(rows, cols)
        m = self._buffers.get(key, "matrix", (rows, cols), torch.float32, src.device)
        m.view(-1)[: src.numel()].copy_(src)
        m.view(-1)[src.numel():].zero_()
        return m

    def project_p(self, m: torch.Tensor, key: Hashable | None) -> torch.Tensor:
        """P = M Q with this key's warm-start Q (or a seeded random one, equal on all ranks)."""
        q = self._start_q(key, m.shape[1], min(self.rank, *m.shape), m.device)
        p = self._buffers.get(key, "p", (m.shape[0], q.shape[1]), torch.float32, m.device)
        return torch.matmul(m, q, out=p)

    @staticmethod
    def orthonormalize(p: torch.Tensor) -> torch.Tensor:
        """Replace the columns of ``p`` by an orthonormal basis of their span (in place)."""
        return p.copy_(torch.linalg.qr(p).Q)

    def project_q(self, m: torch.Tensor, p: torch.Tensor, key: Hashable | None) -> torch.Tensor:
        """Q = M^T P."""
        q = self._buffers.get(key, "q", (m.shape[1], p.shape[1]), torch.float32, m.device)
        return torch.matmul(m.T, p, out=q)

    def remember(self, key: Hashable | None, q: torch.Tensor) -> None:
        """Keep ``q`` (after any all-reduce, so equal on all ranks) as the next warm start."""
        if self.warm_start:
            self._q[key] = q.clone()

    def expand(self, p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write P Q^T, cropped to ``out.numel()`` entries, into the flat ``out``."""
        rows, cols = p.shape[0], q.shape[0]
        flat_out = out.view(-1)
        if rows * cols == flat_out.numel() and out.dtype == torch.float32:
            torch.matmul(p, q.T, out=flat_out.view(rows, cols))
        else:
            flat_out.copy_(torch.matmul(p, q.T).view(-1)[: flat_out.numel()])
        return out

    # -- the Codec interface: the same steps on one rank ---------------------------------------

    def encoded_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        if numel == 0:
            return 0
        rows, cols = self.matrix_shape(numel)
        return (rows + cols) * self.effective_rank(numel) * 4  # the factors are fp32

    def encode(self, tensor: torch.Tensor, *, key: Hashable | None = None) -> Encoded:
        if tensor.numel() == 0:
            empty = torch.empty(0, 0, device=tensor.device)
            return Encoded((empty, empty), tensor.shape, tensor.dtype)
        m = self.as_matrix(tensor, key)
        p = self.orthonormalize(self.project_p(m, key))
        q = self.project_q(m, p, key)
        self.remember(key, q)
        return Encoded((p, q), tensor.shape, tensor.dtype)

    def decode(self, encoded: Encoded, *, out: torch.Tensor | None = None) -> torch.Tensor:
        p, q = encoded.tensors
        dst = output(out, encoded, p.device)
        if encoded.numel:
            self.expand(p, q, dst)
        return dst.view(encoded.shape)

    def state_dict(self) -> dict[str, Any]:
        return {"q": {k: v.clone() for k, v in self._q.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._q = {k: v.clone() for k, v in state["q"].items()}

    def _start_q(self, key: Hashable | None, cols: int, rank: int, device: torch.device) -> torch.Tensor:
        q = self._q.get(key)
        if q is not None and q.shape == (cols, rank):
            return q.to(device)
        # crc32, not hash(): the same seed must give the same Q in every process
        generator = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}".encode()))
        return torch.randn(cols, rank, generator=generator).to(device)
