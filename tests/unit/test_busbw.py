"""The pure parts of ``poise diagnose busbw``: its arguments' units, size ladder, nccl-tests bus factors."""

from __future__ import annotations

import argparse

import pytest

from poise.diagnostics.busbw import OPS, add_arguments, bus_factor, check_arguments, size_ladder


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arguments_give_sizes_in_bytes_and_the_line_rate_in_bytes_per_second():
    sizes, ops, link_bytes_per_s = check_arguments(_args("--min-bytes", "4K", "--max-bytes", "64K", "--link", "1gbit"))
    assert sizes == [4096, 16384, 65536] and ops == list(OPS)
    assert link_bytes_per_s == 125e6  # busbw is in bytes/s, link rates in bits/s
    assert check_arguments(_args("--link", "25GB/s"))[2] == 25e9
    assert check_arguments(_args())[2] is None
    with pytest.raises(ValueError, match="link rate 'fast' is invalid"):
        check_arguments(_args("--link", "fast"))
    with pytest.raises(ValueError, match="size 'lots' is invalid"):
        check_arguments(_args("--max-bytes", "lots"))


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
