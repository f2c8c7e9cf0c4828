"""Codecs and error feedback as pure functions: round-trip bounds, byte counts, summability,
the error-feedback identity, state round trips, NaN handling, and the registry's errors."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from poise.comm import codecs, registry
from poise.comm.builder import HOOKS, check_backend
from poise.comm.codecs import CODECS, ErrorFeedback, NonFiniteGradientError
from poise.comm.codecs.base import Codec
from poise.comm.codecs.lowrank import PowerSGDCodec
from poise.comm.codecs.sign import _pack_signs_numpy, _pack_signs_torch
from poise.comm.state import StepStats
from poise.config import CommConfig

SIZES = (0, 1, 7, 1000, 4099, 70_001)  # 70,001 > 65,536 takes top-k's sampled path


def _x(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# -- registry and options ------------------------------------------------------------------

def test_the_hook_registry_offers_exactly_the_config_names_and_every_codec():
    assert tuple(HOOKS) == tuple(registry.CODECS)
    assert set(CODECS) <= set(HOOKS)


def test_unknown_codec_name_lists_the_valid_ones_on_one_line():
    with pytest.raises(ValueError, match="codec 'zip' is unknown: allowed are none, fp16") as info:
        codecs.make("zip")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_ratio_outside_zero_one_is_refused(name, ratio):
    with pytest.raises(ValueError, match=r"ratio=.* is outside \(0, 1\]"):
        codecs.make(name, ratio=ratio)


def test_bad_options_are_one_line_value_errors():
    with pytest.raises(ValueError, match="codec 'fp16'"):
        codecs.make("fp16", ratio=0.1)
    with pytest.raises(ValueError, match="rank=0"):
        codecs.make("powersgd", rank=0)
    with pytest.raises(ValueError, match="chunk_size=0"):
        codecs.make("int8", chunk_size=0)
    with pytest.raises(ValueError, match="rounding='up'"):
        codecs.make("int8", rounding="up")
    with pytest.raises(ValueError, match="on_nonfinite='ignore'"):
        ErrorFeedback(codecs.make("sign"), on_nonfinite="ignore")


def test_check_backend():
    check_backend(CommConfig(codec="bf16"), "gloo")  # bf16 all-reduce works on gloo (torch 2.13)
    check_backend(CommConfig(codec="torch-fp16"), "gloo")
    with pytest.raises(ValueError, match="backend 'mpi'"):
        check_backend(CommConfig(codec="topk"), "mpi")


# -- shape, dtype, byte counts -------------------------------------------------------------

@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("n", SIZES)
def test_decode_gives_shape_and_dtype_and_nbytes_is_the_payload_size(name, n):
    codec = codecs.make(name)
    x = _x(n)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    assert codec.nbytes(encoded) == sum(t.numel() * t.element_size() for t in encoded.tensors)
    assert codec.encoded_nbytes(n, x.dtype) == codec.nbytes(encoded)
    assert ErrorFeedback(codec).encoded_nbytes(n) == codec.nbytes(encoded)
    out = torch.empty_like(x)
    assert codec.decode(encoded, out=out).data_ptr() == out.data_ptr()


@pytest.mark.parametrize("name", list(CODECS))
def test_decode_keeps_a_2d_shape_and_other_dtypes(name):
    codec = codecs.make(name)
    x = _x(600, dtype=torch.float64).view(20, 30)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    assert decoded.shape == (20, 30) and decoded.dtype == torch.float64
    # encoded_nbytes knows no shape: it is the size of the flat tensor's payload (PowerSGD
    # lays a 2-D tensor out by its own shape, a flat one as a near-square matrix)
    assert codec.encoded_nbytes(600, torch.float64) == codec.nbytes(codec.encode(x.view(-1)))


@pytest.mark.parametrize("n", SIZES)
def test_wire_sizes_follow_each_codecs_formula(n):
    x = _x(n)
    k = 0 if n == 0 else max(1, math.ceil(0.01 * n))
    expected = {
        "none": 4 * n,
        "fp16": 2 * n,
        "bf16": 2 * n,
        "int8": n + 4 * math.ceil(n / 1024),
        "sign": math.ceil(n / 8) + 4,
        "topk": 4 + 4 * math.ceil(n / 65536) + 4 * k,  # scale, block counts, fp16 value + int16 offset
        "randomk": 4 * k,
    }
    for name, nbytes in expected.items():
        codec = codecs.make(name)
        assert codec.nbytes(codec.encode(x)) == nbytes, name
    codec = codecs.make("powersgd", rank=2)
    layout = codec.layout(n)
    assert codec.nbytes(codec.encode(x)) == codec.encoded_nbytes(n) == 4 * layout.wire_numel
    assert sum(b.rows * b.cols for b in layout.blocks) + layout.dense_numel == n


# -- round-trip error bounds ---------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_casts_round_trip_within_their_precision(n):
    x = _x(n)
    assert torch.equal(codecs.make("none").decode(codecs.make("none").encode(x)), x)
    for name, eps in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        codec = codecs.make(name)
        err = (codec.decode(codec.encode(x)) - x).abs()
        assert (err <= x.abs() * eps + 1e-7).all(), name


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk_size", [1, 100, 1024])
def test_int8_error_is_at_most_half_a_step_per_chunk(n, chunk_size):
    x = _x(n) * torch.linspace(0.01, 100, n)  # chunks of very different magnitude
    x[: min(n, 50)] = 0.0  # an all-zero chunk
    codec = codecs.make("int8", chunk_size=chunk_size)
    encoded = codec.encode(x)
    err = (codec.decode(encoded) - x).abs()
    scales, q = encoded.tensors
    step = scales.repeat_interleave(chunk_size)[:n]
    assert (err <= step / 2 + 1e-6 * x.abs() + 1e-12).all()
    assert int(q.abs().max()) <= 127 if n else True


def test_int8_stochastic_rounding_is_within_one_step_and_unbiased():
    codec = codecs.make("int8", chunk_size=64, rounding="stochastic", seed=1)
    x = _x(6400)
    step = codec.encode(x).tensors[0].repeat_interleave(64)
    decodes = torch.stack([codec.decode(codec.encode(x)) for _ in range(200)])
    assert ((decodes - x).abs() <= step + 1e-6).all()
    assert (decodes.mean(0) - x).abs().mean() < 0.1 * step.mean()


@pytest.mark.parametrize("n", [*SIZES, 8, 9, 15, 16, 17])
def test_sign_decodes_to_signed_mean_magnitude(n):
    x = _x(n)
    decoded = codecs.make("sign").decode(codecs.make("sign").encode(x))
    want = torch.where(x < 0, -1.0, 1.0) * (x.abs().mean() if n else 0.0)
    torch.testing.assert_close(decoded, want)


@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 13, 64, 65, 70_007])
def test_sign_bits_pack_the_same_in_numpy_and_torch_on_odd_lengths(n):
    x = _x(n)
    x[::3] = -x[::3].abs()
    fast = torch.empty((n + 7) // 8, dtype=torch.uint8)
    portable = torch.empty_like(fast)
    _pack_signs_numpy(x.numpy(), fast.numpy())
    _pack_signs_torch(x, portable)
    assert torch.equal(fast, portable)
    bits = [(int(fast[i // 8]) >> (i % 8)) & 1 for i in range(n)]  # little-endian within a byte
    assert bits == (x < 0).int().tolist()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("exact", [True, False])
def test_topk_keeps_exactly_the_largest_magnitudes(n, exact):
    x = _x(n)
    codec = codecs.make("topk", ratio=0.01, exact=exact)
    decoded = codec.decode(codec.encode(x))
    k = 0 if n == 0 else max(1, math.ceil(0.01 * n))
    kept = decoded != 0
    assert int(kept.sum()) == k
    torch.testing.assert_close(decoded[kept], x[kept], rtol=2**-11, atol=0)  # fp16 values, scaled
    if k:
        assert set(kept.nonzero().view(-1).tolist()) == set(torch.topk(x.abs(), k).indices.tolist())


def test_topk_fast_path_falls_back_when_the_sample_misleads(caplog):
    x = torch.linspace(0.001, 1.0, 200_000)
    x[::3] = 0.0  # the sample (every 3rd entry) sees zeros ...
    x[0:3000:3] = 10.0  # ... and 1,000 large entries: its threshold keeps fewer than k = 2,000
    codec = codecs.make("topk", ratio=0.01)
    with caplog.at_level("DEBUG", logger="poise.comm.codecs.topk"):
        decoded = codec.decode(codec.encode(x))
    assert "exact pass" in caplog.text
    assert set(decoded.nonzero().view(-1).tolist()) == set(torch.topk(x.abs(), 2000).indices.tolist())


def test_topk_fast_path_keeps_every_entry_larger_than_a_tie_at_the_kth_value():
    x = torch.zeros(100_000)
    x[:50_000:10] = 1.0  # 5,000 ties at the k-th value (k = 1,000), ahead of the larger entries
    x[60_000:60_600] = -torch.linspace(2.0, 3.0, 600)
    codec = codecs.make("topk", ratio=0.01)
    decoded = codec.decode(codec.encode(x, key=0))
    indices = decoded.nonzero().view(-1)
    assert indices.numel() == 1000
    assert set(range(60_000, 60_600)) <= set(indices.tolist())  # all 600 larger entries
    torch.testing.assert_close(decoded[indices], x[indices], rtol=2**-11, atol=0)
    assert indices[indices < 50_000].tolist() == list(range(0, 4000, 10))  # 400 ties, in index order


def test_topk_wire_format_is_scale_block_counts_fp16_values_and_int16_offsets():
    n = 3 * 65536 + 7  # a partial last block
    x = torch.zeros(n)
    spots = torch.tensor([0, 5, 65535, 65536, 2 * 65536 + 40000, n - 1])
    x[spots] = torch.tensor([20.0, -8.0, 7e4, 9.0, -1e5, 30.0])  # past fp16's range before scaling
    codec = codecs.make("topk", ratio=6 / n)
    scale, counts, values, offsets = codec.encode(x).tensors
    assert (scale.dtype, counts.dtype, values.dtype, offsets.dtype) == (
        torch.float32, torch.int32, torch.float16, torch.int16)
    assert scale.item() == 1e5 and counts.tolist() == [3, 1, 1, 1]
    assert (offsets.long() & 0xFFFF).tolist() == [0, 5, 65535, 0, 40000, 6]
    decoded = codec.decode(codec.encode(x))
    assert decoded.nonzero().view(-1).tolist() == spots.tolist()
    torch.testing.assert_close(decoded[spots], x[spots], rtol=2**-11, atol=0)


@pytest.mark.parametrize("n", SIZES)
def test_randomk_sends_the_values_at_the_shared_indices(n):
    x = _x(n)
    a, b = codecs.make("randomk", ratio=0.1, seed=3), codecs.make("randomk", ratio=0.1, seed=3)
    ea, eb = a.encode(x, key=5), b.encode(_x(n, seed=1), key=5)
    assert torch.equal(ea.context, eb.context)  # two "ranks": same indices, nothing sent for them
    decoded = a.decode(ea)
    want = torch.zeros(n)
    want[ea.context] = x[ea.context]
    assert torch.equal(decoded, want)
    assert not torch.equal(a.encode(x, key=5).context, ea.context) or n <= 1  # next step, new indices


def test_powersgd_is_exact_on_low_rank_input_and_a_projection_otherwise():
    g = torch.Generator().manual_seed(0)
    low = (torch.randn(50, 3, generator=g) @ torch.randn(3, 50, generator=g)).view(-1)
    codec = codecs.make("powersgd", rank=4)
    torch.testing.assert_close(codec.decode(codec.encode(low)), low, atol=1e-4, rtol=1e-4)
    x = _x(4099)
    decoded = codec.decode(codec.encode(x))
    assert decoded.norm() <= x.norm() and (x - decoded).norm() < x.norm()


def test_powersgd_layout_compresses_each_weight_matrix_and_sends_the_rest_as_is():
    codec = PowerSGDCodec(rank=4)
    shapes = [(64,), (64, 128), (8, 8), (16, 5, 7), (10,)]
    layout = codec.layout(sum(math.prod(s) for s in shapes), shapes)
    # (64, 128) and (16, 35) shrink; the vectors and the 8x8 matrix (factors not 2x smaller) do not
    second = 64 + 8192 + 64
    assert [(b.start, b.rows, b.cols, b.rank) for b in layout.blocks] == [(64, 64, 128, 4), (second, 16, 35, 4)]
    assert layout.dense == ((0, 64), (64 + 8192, second), (second + 560, second + 570))
    assert layout.p_numel == (64 + 16) * 4 and layout.q_numel == (128 + 35) * 4
    assert layout.dense_numel == 64 + 64 + 10
    # shapes that do not add up to the tensor: one near-square matrix of whole rows + a tail
    fallback = codec.layout(4099, [(10, 10)])
    assert fallback == codec.layout(4099) and fallback.dense == ((4095, 4099),)


def test_powersgd_per_matrix_round_trip_is_exact_on_low_rank_matrices_and_dense_parts():
    g = torch.Generator().manual_seed(1)
    low = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)
    bias = torch.randn(40, generator=g)
    x = torch.cat([low.view(-1), bias])
    codec = PowerSGDCodec(rank=2)
    layout = codec.layout(x.numel(), [low.shape, bias.shape])
    p = torch.empty(layout.p_numel)
    codec.orthonormalize(codec.project_p(x, layout, 0, p), layout)
    q = codec.project_q(x, p, layout, 0)
    dense = torch.empty(layout.dense_numel)
    layout.gather_dense(x, dense)
    out = codec.expand(layout, p, q, torch.empty_like(x), dense)
    torch.testing.assert_close(out, x, atol=1e-4, rtol=1e-4)
    two_d = codec.encode(low)  # a 2-D tensor on its own is one block of its own shape
    assert two_d.context.blocks[0].rows == 40 and codec.decode(two_d).shape == low.shape


def test_powersgd_warm_start_improves_the_approximation_over_steps():
    x = _x(4096) + (torch.randn(64, 1) @ torch.randn(1, 64)).view(-1) * 3
    codec = codecs.make("powersgd", rank=1)
    errors = [float((codec.decode(codec.encode(x, key=0)) - x).norm()) for _ in range(4)]
    assert errors[-1] <= errors[0]


# -- summable payloads ---------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n, c in CODECS.items() if c.summable])
def test_summable_payloads_decode_to_the_sum_of_decodes(name):
    options = {"ratio": 0.2, "seed": 9} if name == "randomk" else {}
    a, b = codecs.make(name, **options), codecs.make(name, **options)  # two ranks
    x, y = _x(3001, seed=1), _x(3001, seed=2)
    ex, ey = a.encode(x, key=0), b.encode(y, key=0)
    separately = a.decode(ex) + b.decode(ey)
    summed = ex.with_tensors([ex.tensors[0] + ey.tensors[0]])
    tol = {"fp16": 2e-3, "bf16": 2e-2}.get(name, 0.0)
    torch.testing.assert_close(a.decode(summed), separately, atol=tol, rtol=0)


@pytest.mark.parametrize("name", [n for n, c in CODECS.items() if not c.summable and n != "powersgd"])
def test_decode_sum_is_the_sum_of_decodes(name):
    codec = codecs.make(name)
    encoded = [codec.encode(_x(2001, seed=s)) for s in range(3)]
    want = sum(codec.decode(e) for e in encoded)
    torch.testing.assert_close(codec.decode_sum(encoded, out=torch.empty(2001)), want)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 2001, 70_001])
def test_sign_fused_decode_sum_equals_decoding_rank_by_rank(n):
    codec = codecs.make("sign")
    for ranks in (1, 2, 4):
        encoded = [codec.encode(_x(n, seed=s), key=s) for s in range(ranks)]
        one_by_one = Codec.decode_sum(codec, encoded, out=torch.empty(n))  # the generic loop
        assert torch.equal(codec.decode_sum(encoded, out=torch.empty(n)), one_by_one), ranks


# -- error feedback -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CODECS))
def test_error_feedback_identity_and_nothing_is_lost(name):
    ef = ErrorFeedback(codecs.make(name))
    inner = codecs.make(name)
    grads = [_x(3001, seed=s) for s in range(4)]
    sent = torch.zeros(3001)
    residual = torch.zeros(3001)
    for g in grads:
        corrected = g + residual
        encoded = ef.encode(g, key=0)
        decoded = ef.decode(encoded)
        # residual = corrected - decode(encode(corrected))
        torch.testing.assert_close(ef.residual(0), corrected - decoded, atol=1e-5, rtol=0)
        if name != "powersgd" and name != "randomk":  # stateful codecs: another instance differs
            torch.testing.assert_close(decoded, inner.decode(inner.encode(corrected)), atol=1e-6, rtol=0)
        residual = ef.residual(0).clone()
        sent += decoded
    # what was sent plus what is still owed is exactly what was computed
    torch.testing.assert_close(sent + residual, sum(grads), atol=1e-4, rtol=0)


def test_error_feedback_keeps_one_residual_per_key_and_drops_one_of_another_size():
    ef = ErrorFeedback(codecs.make("sign"))
    ef.encode(_x(100), key="a")
    ef.encode(_x(50), key="b")
    assert ef.residual("a").numel() == 100 and ef.residual("b").numel() == 50
    ef.encode(_x(80), key="a")  # DDP rebuilt its buckets: the old residual is not added
    assert ef.residual("a").numel() == 80


@pytest.mark.parametrize("name", ["topk", "powersgd", "randomk", "int8"])
def test_error_feedback_state_dict_round_trip(name):
    first = ErrorFeedback(codecs.make(name))
    for s in range(3):
        first.encode(_x(5000, seed=s), key=0)
    state = first.state_dict()
    second = ErrorFeedback(codecs.make(name))
    second.load_state_dict(state)
    assert torch.equal(second.residual(0), first.residual(0))
    a, b = first.encode(_x(5000, seed=9), key=0), second.encode(_x(5000, seed=9), key=0)
    assert torch.equal(first.decode(a), second.decode(b))
    assert torch.equal(first.residual(0), second.residual(0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_raises_in_error_mode(bad):
    ef = ErrorFeedback(codecs.make("topk"))
    ef.encode(_x(1000), key=0)
    before = ef.residual(0).clone()
    g = _x(1000, seed=1)
    g[17] = bad
    with pytest.raises(NonFiniteGradientError, match="bucket 0 holds 1 NaN/Inf entries of 1000"):
        ef.encode(g, key=0)
    assert torch.equal(ef.residual(0), before)


@pytest.mark.parametrize("name", list(CODECS))
def test_nonfinite_gradient_in_skip_mode_keeps_the_residual_and_sends_nan(name, caplog):
    ef = ErrorFeedback(codecs.make(name), on_nonfinite="skip")
    ef.encode(_x(1000), key=0)
    before = ef.residual(0).clone()
    g = _x(1000, seed=1)
    g[3] = float("nan")
    decoded = ef.decode(ef.encode(g, key=0))
    assert not torch.isfinite(decoded).all()
    assert torch.equal(ef.residual(0), before)
    assert ef.num_skipped == 1
    assert "NaN/Inf" in caplog.text
    ef.encode(_x(1000, seed=2), key=0)  # the next finite step proceeds normally
    assert torch.isfinite(ef.residual(0)).all()


def test_step_stats_compression_ratio():
    assert StepStats(raw_bytes=1000, wire_bytes=10).compression_ratio == 100.0
    assert StepStats().compression_ratio == 1.0


# -- numba kernels against the numpy/torch paths ---------------------------------------------

def _awkward(n: int, seed: int = 0) -> torch.Tensor:
    """Random entries over many magnitudes, with the values that trip kernels: an all-zero
    chunk, -0.0, exact rounding ties, subnormals and huge entries."""
    x = _x(n, seed) * torch.logspace(-3, 3, n) if n else _x(0)
    special = torch.tensor([0.0, -0.0, 127.0, 0.5, -0.5, 1.5, -2.5, 63.5, 1e-40, -1e-42, 3e38, -3e38])
    x[: min(n, 40)] = 0.0
    m = min(max(n - 50, 0), special.numel())
    x[50: 50 + m] = special[:m]
    return x


@pytest.fixture(params=["one span", "many spans"])
def numba_kernels(request, monkeypatch):
    """The kernels module with numba present; 'many spans' cuts even small inputs across threads."""
    pytest.importorskip("numba")
    from poise.comm.codecs import kernels

    assert kernels.AVAILABLE
    if request.param == "many spans":
        monkeypatch.setattr(kernels, "MIN_SPAN", 64)
    return kernels


def _both_paths(monkeypatch, kernels, fn):
    """``fn()`` with the numba kernels, then with numba switched off (the fallback path)."""
    fast = fn()
    monkeypatch.setattr(kernels, "AVAILABLE", False)
    slow = fn()
    monkeypatch.setattr(kernels, "AVAILABLE", True)
    return fast, slow


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 1023, 1025, 4099, 70_001])
@pytest.mark.parametrize("chunk_size", [1, 3, 100, 1024])
def test_int8_numba_kernels_match_the_torch_path_bit_for_bit(n, chunk_size, numba_kernels, monkeypatch):
    x = _awkward(n)

    def run():
        codec = codecs.make("int8", chunk_size=chunk_size)
        encoded = codec.encode(x, key=0)
        return [t.clone() for t in encoded.tensors], codec.decode(encoded), encoded

    (fast_t, fast_d, _fast_enc), (slow_t, slow_d, slow_enc) = _both_paths(monkeypatch, numba_kernels, run)
    assert torch.equal(fast_t[0], slow_t[0])  # scales
    assert torch.equal(fast_t[1], slow_t[1])  # int8 entries
    assert torch.equal(fast_d, slow_d)
    # each path decodes the other's payload alike
    codec = codecs.make("int8", chunk_size=chunk_size)
    assert torch.equal(codec.decode(slow_enc), fast_d)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_int8_numba_kernels_match_the_torch_path_on_nonfinite_chunks(bad, numba_kernels, monkeypatch):
    x = _awkward(5000)
    x[1500] = bad  # chunk 1 of 4 (chunk_size 1024) is poisoned; the others are unaffected

    def run():
        codec = codecs.make("int8")
        encoded = codec.encode(x, key=0)
        return [t.clone() for t in encoded.tensors], codec.decode(encoded)

    (fast_t, fast_d), (slow_t, slow_d) = _both_paths(monkeypatch, numba_kernels, run)
    torch.testing.assert_close(fast_t[0], slow_t[0], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(fast_t[1], slow_t[1])
    torch.testing.assert_close(fast_d, slow_d, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(fast_d[1024:2048]).all() and torch.isfinite(fast_d[2048:]).all()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 4099, 70_001, 70_007])
def test_sign_numba_kernels_match_the_numpy_path(n, numba_kernels, monkeypatch):
    x = _awkward(n).clamp(-1e30, 1e30)  # sasum's float32 sum overflows to inf near 3e38
    x[::3] = -x[::3].abs()

    def run():
        codec = codecs.make("sign")
        encoded = codec.encode(x, key=0)
        return [t.clone() for t in encoded.tensors], codec.decode(encoded), encoded

    (fast_t, fast_d, _fast_enc), (slow_t, _slow_d, slow_enc) = _both_paths(monkeypatch, numba_kernels, run)
    assert torch.equal(fast_t[1], slow_t[1])  # the packed bits: the same wire format
    torch.testing.assert_close(fast_t[0], slow_t[0], rtol=2e-6, atol=0)  # scale: float64 vs sasum's float32 sum
    torch.testing.assert_close(fast_t[0], x.abs().double().mean().float().view(1) if n else torch.zeros(1),
                               rtol=1e-6, atol=0)
    # on one payload, both decoders give the same entries bit for bit
    fast_again, slow_again = _both_paths(monkeypatch, numba_kernels, lambda: codecs.make("sign").decode(slow_enc))
    assert torch.equal(fast_again, slow_again)
    assert torch.equal(fast_d, torch.where(x < 0, -fast_t[0], fast_t[0]))


def test_sign_numba_kernels_match_the_numpy_path_on_nonfinite_entries(numba_kernels, monkeypatch):
    x = _awkward(1001)
    x[[3, 500, 1000]] = torch.tensor([float("nan"), -float("inf"), -float("nan")])

    def run():
        codec = codecs.make("sign")
        encoded = codec.encode(x, key=0)
        return [t.clone() for t in encoded.tensors], codec.decode(encoded)

    (fast_t, fast_d), (slow_t, slow_d) = _both_paths(monkeypatch, numba_kernels, run)
    assert torch.equal(fast_t[1], slow_t[1])  # NaN < 0 is False: bit clear, in both
    assert torch.isnan(fast_t[0]).all() and torch.isnan(slow_t[0]).all()
    assert torch.isnan(fast_d).all() and torch.isnan(slow_d).all()


def test_int8_and_sign_work_without_numba():
    """With numba missing (an import that fails), the codecs take their numpy/torch paths, and
    the first codec call says so in one log line, once per process."""
    script = (
        "import sys; sys.modules['numba'] = None\n"
        "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "import torch\n"
        "from poise.comm import codecs\n"
        "from poise.comm.codecs import kernels\n"
        "assert not kernels.AVAILABLE\n"
        "x = torch.randn(5001, generator=torch.Generator().manual_seed(0))\n"
        "for name in ('int8', 'sign'):\n"
        "    codec = codecs.make(name)\n"
        "    y = codec.decode(codec.encode(x, key=0))\n"
        "    assert y.shape == x.shape and torch.isfinite(y).all()\n"
        "    assert torch.equal(y < 0, x < 0) or name == 'int8'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("CPU codecs:")]
    assert said == ["CPU codecs: numpy/torch paths, numba is not installed (pip install numba, or poise's "
                    "'kernels' extra, for the fused kernels)"], done.stderr


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 70_001, 300_007])
@pytest.mark.parametrize("threshold", [0.0, 1.5, 3.0, float("inf")])
def test_topk_numba_scan_matches_the_numpy_scan(n, threshold, numba_kernels):
    from poise.comm.codecs.topk import _entries_at_least

    x = _awkward(n, seed=3)
    x[7: min(n, 9)] = torch.tensor([float("nan"), -float("inf")])[: max(0, min(n, 9) - 7)]
    xn = x.numpy()
    want_index, want_values = _entries_at_least(xn, threshold)
    found = numba_kernels.entries_at_least(xn, threshold, n + 16)
    assert found is not None
    assert np.array_equal(found[0], want_index) and np.array_equal(found[1], want_values)
    if want_index.size:  # more entries than room: None, and the caller scans with numpy
        assert numba_kernels.entries_at_least(xn, threshold, 0) is None


@pytest.mark.parametrize("n", [70_001, 300_007])
def test_topk_numba_path_keeps_the_same_entries(n, numba_kernels, monkeypatch):
    x = _x(n, seed=4)

    def run():
        codec = codecs.make("topk", ratio=0.01)
        return [t.clone() for t in codec.encode(x, key=0).tensors]

    fast, slow = _both_paths(monkeypatch, numba_kernels, run)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
