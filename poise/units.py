"""Rates, durations and byte sizes as users write them: parsed and formatted in one place.

Conventions inside poise, carried in every name:

- A link or line rate is in **bits per second** (``*_bit_per_s``), the way ``tc`` and network
  vendors quote links. Code that divides bytes by a rate converts with ``/ 8`` and names the
  result ``*_bytes_per_s`` (busbw, the pipeline's cost model).
- A duration is in seconds (``*_s``).
- A size is in bytes; ``K``/``M``/``G`` in a size are powers of 1024 (4K = 4096, like
  nccl-tests' ``-b``/``-e``), while ``k``/``m``/``g`` in a rate are powers of 1000, like ``tc``.

This module is a leaf: it imports nothing from poise, so config, CLI, cluster, benches and
diagnostics can all use it. It also bounds the rates and delays an emulated node's link can
be given (:func:`link_rate_bit_per_s`, :func:`link_delay_s`): the config checks them before
anything starts, and ``poise/cluster/links.py`` shapes links with the result. Every error is
a one-line ``ValueError`` naming the text and what is allowed.
"""

from __future__ import annotations

import re

# rate units, in bits per second each; tc writes bit rates, "B/s" (any case) are bytes
_RATE_UNITS_BIT_PER_S = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
                         "b/s": 8, "kb/s": 8 * 10**3, "mb/s": 8 * 10**6, "gb/s": 8 * 10**9}
_RATE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z/]+)\s*")
_RATE_FORMAT_UNITS = ("tbit", "gbit", "mbit", "kbit")
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*")
_DURATION_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)i?B?\s*", re.IGNORECASE)
_SIZE_UNITS_BYTES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# What a shaped link can carry (tc's tbf, on veth) and what netem can delay it by.
MIN_LINK_RATE_BIT_PER_S = 64 * 10**3
MAX_LINK_RATE_BIT_PER_S = 100 * 10**9
MAX_LINK_DELAY_S = 10.0


def parse_rate_bit_per_s(text: str, *, what: str = "rate") -> float:
    """``"1gbit"`` -> 1e9, ``"100mbit"`` -> 1e8, ``"25GB/s"`` -> 2e11: a rate in bits per second.

    Units: ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (powers of 1000, as ``tc`` writes
    them), or bytes per second as ``B/s``, ``KB/s``, ``MB/s``, ``GB/s``; case is ignored.
    ``what`` names the value in the error (``"link rate"``).

    Raises:
        ValueError: not a positive number followed by one of those units.
    """
    match = _RATE.fullmatch(str(text).lower())
    scale = _RATE_UNITS_BIT_PER_S.get(match.group(2)) if match else None
    if scale is None or not float(match.group(1)) > 0:
        raise ValueError(
            f"{what} {text!r} is invalid: give a number above 0 and a unit of bit, kbit, mbit, gbit, tbit, "
            f"or B/s, KB/s, MB/s, GB/s for bytes, e.g. 1gbit, 100mbit or 25GB/s"
        )
    return float(match.group(1)) * scale


def format_rate_bit_per_s(bit_per_s: int) -> str:
    """1_000_000_000 -> ``"1gbit"``: the largest ``tc`` unit that writes the rate exactly, so that
    :func:`parse_rate_bit_per_s` reads the same number back."""
    for unit in _RATE_FORMAT_UNITS:
        scale = _RATE_UNITS_BIT_PER_S[unit]
        if bit_per_s % scale == 0:
            return f"{bit_per_s // scale}{unit}"
    return f"{bit_per_s}bit"


def parse_duration_s(text: str, *, what: str = "duration") -> float:
    """``"5ms"`` -> 0.005, ``"250us"`` -> 0.00025: a duration in seconds; ``""`` is none, 0.0.

    Raises:
        ValueError: not a number followed by ``us``, ``ms`` or ``s``.
    """
    if not str(text).strip():
        return 0.0
    match = _DURATION.fullmatch(str(text).lower())
    if not match:
        raise ValueError(f"{what} {text!r} is invalid: give a number and a unit of us, ms or s, e.g. 5ms")
    return float(match.group(1)) * _DURATION_UNITS_S[match.group(2)]


def link_rate_bit_per_s(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000: a rate a node's link can be shaped to, in whole bits per
    second (tc takes whole bits; :func:`parse_rate_bit_per_s` says which units).

    Raises:
        ValueError: naming the text and what is allowed (a unit, and 64kbit..100gbit).
    """
    rate = round(parse_rate_bit_per_s(text, what="link rate"))
    if not MIN_LINK_RATE_BIT_PER_S <= rate <= MAX_LINK_RATE_BIT_PER_S:
        raise ValueError(f"link rate {text!r} is outside the allowed {format_rate_bit_per_s(MIN_LINK_RATE_BIT_PER_S)}.."
                         f"{format_rate_bit_per_s(MAX_LINK_RATE_BIT_PER_S)}")
    return rate


def link_delay_s(text: str) -> float:
    """``"5ms"`` -> 0.005: a one-way link delay netem can add, in seconds (``""`` = none, 0.0).

    Raises:
        ValueError: naming the text and what is allowed (a unit, and 0..10s).
    """
    delay_s = parse_duration_s(text, what="link delay")
    if delay_s > MAX_LINK_DELAY_S:
        raise ValueError(f"link delay {text!r} is outside the allowed 0..{MAX_LINK_DELAY_S:g}s")
    return delay_s


def parse_size_bytes(text: str) -> int:
    """``"4K"`` -> 4096, ``"256M"``, ``"1GiB"`` (powers of 1024) or a plain count: a size in bytes.

    Raises:
        ValueError: not a positive whole number with an optional K, M or G.
    """
    match = _SIZE.fullmatch(str(text))
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"size {text!r} is invalid: give a positive number of bytes like 4096, 4K, 256M, 1G")
    return int(match.group(1)) * _SIZE_UNITS_BYTES[match.group(2).upper()]


def format_size_bytes(size_bytes: int) -> str:
    """4096 -> ``"4K"``, 1536 -> ``"1.5K"``, 100 -> ``"100B"``: the largest power of 1024 that the
    size reaches (the units of :func:`parse_size_bytes`)."""
    for unit in ("G", "M", "K"):
        scale = _SIZE_UNITS_BYTES[unit]
        if size_bytes >= scale:
            return f"{size_bytes / scale:g}{unit}"
    return f"{size_bytes}B"
