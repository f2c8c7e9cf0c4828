"""``[diagnostics]``: what is measured and written."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting


@dataclass(frozen=True, kw_only=True)
class DiagnosticsConfig:
    """What is measured and written."""

    gather_every_steps: int = setting(10, "per-rank step figures are gathered to rank 0 this often")
    log_every_steps: int = setting(10, "rank 0 logs a progress line this often")
    plot: bool = setting(True, "write timeline.png (matplotlib)")
    progress: bool = setting(True, "show a live progress bar on rank 0")
    record_samples: bool = setting(
        False, "write the sample indices each rank trains on, per step, to samples/rank-<r>.jsonl (exactly-once checks)"
    )

    def __post_init__(self) -> None:
        check_finite("diagnostics", self)
        check_positive("diagnostics", "gather_every_steps", self.gather_every_steps, allow_none=False)
        check_positive("diagnostics", "log_every_steps", self.log_every_steps, allow_none=False)

