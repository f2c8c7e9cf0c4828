"""``[straggler]``: straggler-tolerant aggregation, a shared deadline per step."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, setting

STRAGGLER_MODES = ("off", "deadline", "deadline+stale")


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Straggler-tolerant aggregation: a shared deadline per step (see poise/straggler/)."""

    mode: str = setting("off", f"{', '.join(STRAGGLER_MODES)}: deadline = each rank computes micro-batches until "
                        "the step's shared deadline, what it did not reach goes back into the epoch's plan; "
                        "deadline+stale = also, a rank that computed nothing sends its previous gradient (biased)")
    micro_batches: int = setting(4, "deadline: micro-batches per rank per step (its batch cut into this many parts)")
    slack: float = setting(0.25, "deadline: the deadline is (1 + slack) x the median rank's predicted step compute")
    predictor: str = setting("quantile", "deadline: per-rank predictor of micro-batch time: quantile (median of "
                             "the window), ewma, lstm")
    max_staleness: int = setting(1, "deadline+stale: oldest previous gradient sent, in steps")

    def __post_init__(self) -> None:
        check_finite("straggler", self)
        if self.mode not in STRAGGLER_MODES:
            raise ValueError(f"straggler.mode={self.mode!r} is unknown: allowed are {', '.join(STRAGGLER_MODES)}")
        if not 1 <= self.micro_batches <= 1024:
            raise ValueError(f"straggler.micro_batches={self.micro_batches} is outside 1-1024")
        if not 0.0 <= self.slack <= 10.0:
            raise ValueError(f"straggler.slack={self.slack} is outside [0, 10]")
        if self.predictor not in ("quantile", "ewma", "lstm"):
            raise ValueError(f"straggler.predictor={self.predictor!r} is unknown: allowed are quantile, ewma, lstm")
        if not 0 <= self.max_staleness <= 100:
            raise ValueError(f"straggler.max_staleness={self.max_staleness} is outside 0-100")

    @property
    def enabled(self) -> bool:
        """Whether steps run against a deadline."""
        return self.mode != "off"
