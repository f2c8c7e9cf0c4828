"""``[balance]``: how work is split across ranks (see poise/balance/)."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting

BALANCE_STRATEGIES = ("auto", "static", "cost", "dynamic")


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How work is split across ranks (see poise/balance/)."""

    strategy: str = setting(
        "auto", "data split: auto = plain DDP's steps (the same samples), each split by cost and by every rank's "
        "speed measured from its first steps on, into ranges of similar lengths; static = DistributedSampler, "
        "equal sample counts; cost = length-bucketed steps split by cost; dynamic = cost, re-planned from "
        "measured speeds (bucketing changes each step's samples: see docs/decide.md)"
    )
    cost_model: str = setting("auto", "per-sample cost: auto (the task's), linear (L), attention (L + alpha*L^2)")
    cost_alpha: float | None = setting(
        None, "attention cost's alpha per token (default: the task's prior, then fitted)"
    )
    fit_alpha: bool = setting(True, "dynamic: refit alpha from measured step times at each re-plan")
    bucket_steps: int = setting(50, "length bucketing: samples of this many steps are sorted by length together")
    cold_start_steps: int = setting(10, "dynamic: steps on the equal split before the first re-plan")
    window_steps: int = setting(20, "dynamic: most steps of measurements behind each speed estimate (20-100)")
    replan_every_steps: int = setting(5, "dynamic: steps between re-plans after the first")
    max_share_change: float = setting(
        0.15, "dynamic: largest relative change of a rank's share per re-plan while estimates are noisy, (0, 1]"
    )
    confident_error: float = setting(
        0.05, "dynamic: relative standard error of every speed below which a re-plan moves straight to its target"
    )
    replay: str = setting(
        "", "auto, dynamic: a report.json of an earlier run (of the same strategy) whose re-plans are applied at the "
        "same steps instead of measured ones: the same batches again for the same seed ('' = measure)"
    )

    def __post_init__(self) -> None:
        check_finite("balance", self)
        if self.strategy not in BALANCE_STRATEGIES:
            raise ValueError(
                f"balance.strategy={self.strategy!r} is unknown: allowed are {', '.join(BALANCE_STRATEGIES)}"
            )
        if self.cost_model not in ("auto", "linear", "attention"):
            raise ValueError(f"balance.cost_model={self.cost_model!r} is unknown: allowed are auto, linear, attention")
        if self.cost_alpha is not None and self.cost_alpha < 0:
            raise ValueError(f"balance.cost_alpha={self.cost_alpha} must be >= 0")
        check_positive("balance", "bucket_steps", self.bucket_steps, allow_none=False)
        check_positive("balance", "replan_every_steps", self.replan_every_steps, allow_none=False)
        if self.cold_start_steps < 1:
            raise ValueError(f"balance.cold_start_steps={self.cold_start_steps} must be >= 1")
        if not 20 <= self.window_steps <= 100:
            raise ValueError(f"balance.window_steps={self.window_steps} is outside the allowed 20-100")
        if not 0.0 < self.max_share_change <= 1.0:
            raise ValueError(f"balance.max_share_change={self.max_share_change} is outside (0, 1]")
        if not 0.0 <= self.confident_error <= 1.0:
            raise ValueError(f"balance.confident_error={self.confident_error} is outside [0, 1]")
        if self.replay and self.strategy not in ("auto", "dynamic"):
            raise ValueError(f"balance.replay={self.replay!r} replays a run's re-plans: it needs "
                             f"balance.strategy=auto or dynamic (the run's own), not {self.strategy!r}")
