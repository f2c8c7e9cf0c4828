"""poise.units: rates in bits per second, durations in seconds, sizes in bytes."""

from __future__ import annotations

import pytest

from poise.units import (
    format_rate_bit_per_s,
    format_size_bytes,
    parse_duration_s,
    parse_rate_bit_per_s,
    parse_size_bytes,
)


@pytest.mark.parametrize(
    ("text", "bit_per_s"),
    [("500kbit", 500_000), ("100mbit", 10**8), ("1gbit", 10**9), ("10gbit", 10**10), ("2.5Gbit", 25 * 10**8),
     (" 64kbit ", 64_000), ("100gbit", 10**11), ("1tbit", 10**12), ("25GB/s", 2 * 10**11), ("1mb/s", 8 * 10**6),
     ("3B/s", 24)],
)
def test_rates_parse_in_bits_per_second_and_format_back(text, bit_per_s):
    assert parse_rate_bit_per_s(text) == bit_per_s
    assert parse_rate_bit_per_s(format_rate_bit_per_s(bit_per_s)) == bit_per_s


def test_rates_format_with_the_largest_exact_unit():
    assert [format_rate_bit_per_s(r) for r in (10**9, 25 * 10**8, 64_000, 1001)] == ["1gbit", "2500mbit", "64kbit",
                                                                                     "1001bit"]


@pytest.mark.parametrize("text", ["1gbps", "fast", "", "-1gbit", "0gbit", "1.2.3gbit", "1 gallon"])
def test_bad_rates_are_one_line_errors_naming_the_units(text):
    with pytest.raises(ValueError, match="is invalid: give a number above 0 and a unit of bit, kbit") as info:
        parse_rate_bit_per_s(text, what="link rate")
    assert "\n" not in str(info.value) and str(info.value).startswith(f"link rate {text!r}")


def test_durations_parse_in_seconds():
    assert parse_duration_s("") == 0.0
    assert parse_duration_s("5ms") == pytest.approx(0.005)
    assert parse_duration_s("250us") == pytest.approx(250e-6)
    assert parse_duration_s(" 2 S ") == 2.0
    for bad in ("5", "5 sec", "-1ms"):
        with pytest.raises(ValueError, match=f"delay {bad!r} is invalid: give a number and a unit of us, ms or s"):
            parse_duration_s(bad, what="delay")


def test_sizes_parse_in_bytes_with_powers_of_1024():
    assert parse_size_bytes("4K") == 4096
    assert parse_size_bytes("256M") == 256 << 20
    assert parse_size_bytes("1GiB") == 1 << 30
    assert parse_size_bytes("64mb") == 64 << 20
    assert parse_size_bytes("1000") == 1000
    for bad in ("", "-1K", "4X", "0", "1.5M"):
        with pytest.raises(ValueError, match=f"size {bad!r} is invalid"):
            parse_size_bytes(bad)


def test_sizes_format_with_the_largest_unit_reached():
    assert [format_size_bytes(s) for s in (100, 4096, 1536, 256 << 20, 1 << 30)] == ["100B", "4K", "1.5K", "256M",
                                                                                     "1G"]
    for size in (4096, 256 << 20, 1 << 30):
        assert parse_size_bytes(format_size_bytes(size)) == size
