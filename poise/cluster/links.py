"""Link rates and how a link is shaped: pure functions, no system calls.

A rate is written the way ``tc`` writes it, in bits per second with a decimal prefix
(``500kbit``, ``100mbit``, ``1gbit``, ``10gbit``; ``k`` = 10^3). Every node's link is shaped
with a token bucket filter (tbf) in each direction. The bucket (burst) must hold at least one
GSO super-packet (veth hands the qdisc segments of up to 64 KiB) and what the rate delivers in
one millisecond, or tbf splits packets and the link falls short of its rate at 10 Gbit/s;
the queue (limit) holds the burst plus 20 ms at the rate, enough for TCP to keep the link full.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)
MIN_RATE_BIT_PER_S = 64 * 10**3
MAX_RATE_BIT_PER_S = 100 * 10**9
_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*$", re.IGNORECASE)
_DELAY_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
MAX_DELAY_S = 10.0

# veth passes GSO segments of up to 64 KiB to the qdisc; a smaller bucket makes tbf split them.
_MIN_BURST_BYTES = 64 * 1024
_BURST_S = 0.001
_QUEUE_S = 0.020


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000: a link rate in bits per second.

    Raises:
        ValueError: naming the text and what is allowed (a unit, and 64kbit..100gbit).
    """
    match = _RATE.match(str(text))
    if not match:
        raise ValueError(
            f"link rate {text!r} is invalid: give a number and a unit of bit, kbit, mbit or gbit, e.g. 1gbit or 100mbit"
        )
    rate = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not MIN_RATE_BIT_PER_S <= rate <= MAX_RATE_BIT_PER_S:
        raise ValueError(f"link rate {text!r} is outside the allowed 64kbit..100gbit")
    return rate


def format_rate(bit_per_s: int) -> str:
    """1_000_000_000 -> ``"1gbit"``; the largest unit that writes the rate exactly."""
    for unit in ("gbit", "mbit", "kbit"):
        if bit_per_s % _UNITS[unit] == 0:
            return f"{bit_per_s // _UNITS[unit]}{unit}"
    return f"{bit_per_s}bit"


def parse_delay(text: str) -> float:
    """``"5ms"`` -> 0.005: a one-way link delay in seconds (``""`` = none, 0.0).

    Raises:
        ValueError: naming the text and what is allowed.
    """
    if not str(text).strip():
        return 0.0
    match = _DELAY.match(str(text))
    if not match:
        raise ValueError(f"link delay {text!r} is invalid: give a number and a unit of us, ms or s, e.g. 5ms")
    delay_s = float(match.group(1)) * _DELAY_UNITS_S[match.group(2).lower()]
    if delay_s > MAX_DELAY_S:
        raise ValueError(f"link delay {text!r} is outside the allowed 0..10s")
    return delay_s


@dataclass(frozen=True)
class Shaping:
    """One direction of a link as a tbf qdisc: rate in bit/s, bucket and queue in bytes,
    and an optional one-way delay in seconds (a netem qdisc under the tbf)."""

    rate_bit_per_s: int
    burst_bytes: int
    limit_bytes: int
    delay_s: float = 0.0

    @classmethod
    def for_rate(cls, rate_bit_per_s: int, delay_s: float = 0.0) -> Shaping:
        """The bucket and queue sizes for a rate (see the module docstring for why)."""
        rate_bytes_per_s = rate_bit_per_s / 8
        burst = max(_MIN_BURST_BYTES, round(rate_bytes_per_s * _BURST_S))
        # A delayed link holds a bandwidth-delay product in flight; the queue must not drop it.
        limit = burst + max(_MIN_BURST_BYTES, round(rate_bytes_per_s * (_QUEUE_S + 2 * delay_s)))
        return cls(rate_bit_per_s, burst, limit, delay_s)

    def tc_args(self, dev: str) -> list[list[str]]:
        """The ``tc`` argument lists (without ``tc -n NS``) that shape egress of ``dev``."""
        tbf = ["qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{self.rate_bit_per_s}bit",
               "burst", str(self.burst_bytes), "limit", str(self.limit_bytes)]
        if not self.delay_s:
            return [tbf]
        delay_us = max(1, round(self.delay_s * 1e6))
        netem = ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay", f"{delay_us}us",
                 "limit", str(max(1000, self.limit_bytes // 1000))]
        return [tbf, netem]
