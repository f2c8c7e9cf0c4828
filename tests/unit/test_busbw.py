"""The pure parts of ``poise diagnose busbw``: units, size ladder, nccl-tests bus factors."""

from __future__ import annotations

import pytest

from poise.diagnostics.busbw import bus_factor, parse_bytes, parse_rate, size_ladder


def test_sizes_and_rates_parse_with_their_units():
    assert parse_bytes("4K") == 4096
    assert parse_bytes("256M") == 256 << 20
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("1000") == 1000
    assert parse_rate("1gbit") == 125e6
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("25GB/s") == 25e9
    for bad in ("", "-1K", "4X", "0"):
        with pytest.raises(ValueError, match="is invalid"):
            parse_bytes(bad)
    for bad in ("fast", "1 gallon", "0gbit"):
        with pytest.raises(ValueError, match="is invalid"):
            parse_rate(bad)


def test_size_ladder_spans_min_to_max():
    assert size_ladder(4096, 256 << 20, 4)[0] == 4096
    assert size_ladder(4096, 256 << 20, 4)[-1] == 256 << 20
    assert size_ladder(4096, 65536, 2) == [4096, 8192, 16384, 32768, 65536]
    with pytest.raises(ValueError, match="above"):
        size_ladder(8192, 4096, 2)
    with pytest.raises(ValueError, match="at least 2"):
        size_ladder(4096, 8192, 1)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("poise-ring", 2) == pytest.approx(1.0)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0
