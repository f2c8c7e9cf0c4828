"""Every codec of ``poise.comm.registry.CODECS`` on CUDA tensors against its CPU reference.

On the CPU, float32 gradients take numba's fused kernels (``kernels.py``) or numpy paths; on
CUDA the codecs take their torch paths. Both must send the same information: identical
payloads where the arithmetic is exact (casts, signs, top-k's indices, random-k's seeded
indices), the same decode within the rounding of a different summation order (sign's and
int8's scales) or of cuBLAS against the CPU's BLAS (PowerSGD's products and QR, compared as
the decoded matrix, which a QR's column signs do not change). Sizes cross top-k's 2**16-entry
spans and int8's chunks, and reach the CPU's fast paths (2**16 entries and more).
"""

from __future__ import annotations

import pytest
import torch

from poise.comm import registry
from poise.comm.codecs import ErrorFeedback, make
from tests.cuda.common import CUDA

pytestmark = CUDA

# every poise codec the registry offers (auto and torch's own hooks run no codec of their own)
NAMES = sorted({info.codec.name for info in registry.CODECS.values() if info.codec is not None})
OPTIONS = {"topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "powersgd": {"rank": 4}}
NUMEL = 3 * 65536 + 1000


def _x(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _pair(name: str, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor,
                                                   torch.Tensor]:
    """(CPU payload, CUDA payload moved to the CPU, CPU decode, CUDA decode moved to the CPU),
    each side with a fresh codec (stateful codecs start from the same seed)."""
    cpu, gpu = make(name, **OPTIONS.get(name, {})), make(name, **OPTIONS.get(name, {}))
    enc_cpu, enc_gpu = cpu.encode(x, key=0), gpu.encode(x.cuda(), key=0)
    assert all(t.device.type == "cuda" for t in enc_gpu.tensors), name  # the payload stays on the device
    decoded_gpu = gpu.decode(enc_gpu)
    assert decoded_gpu.device.type == "cuda" and decoded_gpu.dtype == x.dtype
    return enc_cpu.tensors, tuple(t.cpu() for t in enc_gpu.tensors), cpu.decode(enc_cpu), decoded_gpu.cpu()


def test_every_codec_is_covered():
    assert {"none", "fp16", "bf16", "int8", "sign", "topk", "randomk", "powersgd"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_on_cuda_matches_the_cpu_reference(name):
    x = _x(0)
    pay_cpu, pay_gpu, dec_cpu, dec_gpu = _pair(name, x)
    assert [t.dtype for t in pay_cpu] == [t.dtype for t in pay_gpu]
    assert [t.shape for t in pay_cpu] == [t.shape for t in pay_gpu]
    if name in ("none", "fp16", "bf16", "randomk", "topk"):  # exact arithmetic: the same bits
        for a, b in zip(pay_cpu, pay_gpu, strict=True):
            torch.testing.assert_close(b, a, atol=0, rtol=0)
        torch.testing.assert_close(dec_gpu, dec_cpu, atol=0, rtol=0)
    elif name == "sign":  # scale, packed bits: the bits are signs, the scale an L1 norm summed differently
        torch.testing.assert_close(pay_gpu[0], pay_cpu[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(pay_gpu[1], pay_cpu[1], atol=0, rtol=0)
        torch.testing.assert_close(dec_gpu, dec_cpu, rtol=1e-5, atol=0)
    elif name == "int8":  # scales, codes: a code may differ by one where x * (127 / peak) lands on .5
        scales_cpu, scales_gpu = pay_cpu[0], pay_gpu[0]
        torch.testing.assert_close(scales_gpu, scales_cpu, rtol=1e-6, atol=0)
        assert (pay_gpu[1].int() - pay_cpu[1].int()).abs().max() <= 1
        assert (dec_gpu - dec_cpu).abs().max() <= scales_cpu.max() * 1.0001
    else:
        assert name == "powersgd", f"codec {name!r} has no comparison here: add one"
        error = (dec_gpu - dec_cpu).norm() / dec_cpu.norm()
        assert error < 1e-4, f"PowerSGD's decode on CUDA differs from the CPU's by {error:.2e} (relative)"


@pytest.mark.parametrize("name", NAMES)
def test_decode_sum_of_several_ranks_on_cuda_matches_the_cpu(name):
    """What a reducer does with gathered payloads: the sum of their decodes, on the device."""
    cpu, gpu = make(name, **OPTIONS.get(name, {})), make(name, **OPTIONS.get(name, {}))
    xs = [_x(seed) for seed in (1, 2, 3)]
    # stateful codecs (random-k's call counter, PowerSGD's warm start) advance alike on both sides
    enc_cpu = [cpu.encode(x, key=k) for k, x in enumerate(xs)]
    enc_gpu = [gpu.encode(x.cuda(), key=k) for k, x in enumerate(xs)]
    want = cpu.decode_sum(enc_cpu, out=torch.empty(NUMEL))
    got = gpu.decode_sum(enc_gpu, out=torch.empty(NUMEL, device="cuda")).cpu()
    # top-k's scatter-add runs in a nondeterministic order on CUDA (atomics): rounding only
    tolerance = {"powersgd": 1e-4, "sign": 1e-5, "int8": 1e-3, "topk": 1e-6}.get(name, 0.0)
    error = float((got - want).norm() / want.norm())
    assert error <= tolerance, f"{name}: decode_sum on CUDA differs from the CPU's by {error:.2e} (relative)"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "none"])
def test_error_feedback_keeps_its_residual_on_the_device(name):
    """corrected = x + residual and residual = corrected - decode(payload), on CUDA, step after step."""
    ef = ErrorFeedback(make(name, **OPTIONS.get(name, {})))
    residual = torch.zeros(NUMEL, device="cuda")
    for step in range(3):
        x = _x(10 + step).cuda()
        encoded = ef.encode(x, key=0)
        new = ef.residual(0)
        assert new is not None and new.device.type == "cuda"
        torch.testing.assert_close(ef.decode(encoded) + new, x + residual, rtol=1e-5, atol=1e-5)
        residual = new.clone()
