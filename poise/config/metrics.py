"""``[metrics]``: live metrics for Prometheus, served by rank 0."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from poise.config.fields import setting


@dataclass(frozen=True, kw_only=True)
class MetricsConfig:
    """Live metrics for Prometheus, served by rank 0 (see poise/diagnostics/metrics.py)."""

    port: int | None = setting(
        None, "serve Prometheus metrics on this TCP port from rank 0 (0 = a free port, logged; unset = off)"
    )
    host: str = setting("127.0.0.1", "address the metrics endpoint binds to (0.0.0.0: every interface)")

    def __post_init__(self) -> None:
        if self.port is not None and (isinstance(self.port, bool) or not 0 <= self.port <= 65535):
            raise ValueError(f"metrics.port={self.port!r} is outside 0-65535 (0 picks a free port)")
        if not self.host.strip():
            raise ValueError("metrics.host is empty: give an address such as 127.0.0.1 or 0.0.0.0")
        if not _is_address(self.host):
            raise ValueError(f"metrics.host={self.host[:80]!r} is invalid: give an IP address of this machine, "
                             "such as 127.0.0.1, 0.0.0.0 or ::1, or localhost")

    @property
    def enabled(self) -> bool:
        """Whether the endpoint is served at all."""
        return self.port is not None


def _is_address(host: str) -> bool:
    """Whether ``host`` is an IP address or ``localhost``: what rank 0 can bind without a name
    lookup, which the config cannot do (no network, or another machine's resolver)."""
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
