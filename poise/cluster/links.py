"""How a link is shaped: pure functions, no system calls.

A rate is written the way ``tc`` writes it, in bits per second with a decimal prefix
(``500kbit``, ``100mbit``, ``1gbit``, ``10gbit``; ``k`` = 10^3; parsed and bounded to what a
shaped link can carry by :func:`poise.units.link_rate_bit_per_s`). Every node's link is shaped
with a token bucket filter (tbf) in each direction. The bucket (burst) must hold at least one
GSO super-packet (veth hands the qdisc segments of up to 64 KiB) and what the rate delivers in
one millisecond, or tbf splits packets and the link falls short of its rate at 10 Gbit/s;
the queue (limit) holds the burst plus 20 ms at the rate, enough for TCP to keep the link full.
"""

from __future__ import annotations

from dataclasses import dataclass

# veth passes GSO segments of up to 64 KiB to the qdisc; a smaller bucket makes tbf split them.
_MIN_BURST_BYTES = 64 * 1024
_BURST_S = 0.001
_QUEUE_S = 0.020


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
