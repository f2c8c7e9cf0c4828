"""``[pipeline]``: pipeline parallelism (``poise pipeline``), one stage per worker, optionally
replicated ``dp_size`` times for data parallelism (world = stages x dp_size)."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting

# poise.balance.partition.METHODS and poise.pipeline.stage.SCHEDULES, by name.
PARTITION_METHODS = ("exact", "uniform", "parameters", "greedy")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism (``poise pipeline``): one stage per worker, see poise/pipeline/."""

    dp_size: int = setting(
        1, "data-parallel replicas of the whole pipeline: world = stages x dp_size; each stage is DDP over "
        "its replicas with comm.codec; a step is dp_size x train.batch_size samples, split between the "
        "replicas in whole micro-batches (see poise/pipeline/replicas.py)"
    )

    schedule: str = setting("1f1b", f"pipeline schedule: {', '.join(PIPELINE_SCHEDULES)}")
    micro_batches: int = setting(4, "micro-batches per step (train.batch_size samples are cut into this many)")
    partition: str = setting("exact", f"how layers are split into stages: {', '.join(PARTITION_METHODS)}")
    link_bandwidth_bytes_per_s: float = setting(
        0.0, "link bandwidth between stages for the plan's communication cost (0 = not modelled)"
    )
    memory_cap_bytes: float = setting(0.0, "most bytes one stage may hold, exact plan only (0 = no cap)")
    profile_repeats: int = setting(5, "timed runs per layer when profiling (median is used)")
    profile_warmup: int = setting(2, "untimed runs per layer before profiling")
    warmup_steps: int = setting(2, "first steps left out of the measured stage times")

    def __post_init__(self) -> None:
        check_finite("pipeline", self)
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline.schedule={self.schedule!r} is unknown: allowed are {', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.partition not in PARTITION_METHODS:
            raise ValueError(
                f"pipeline.partition={self.partition!r} is unknown: allowed are {', '.join(PARTITION_METHODS)}"
            )
        check_positive("pipeline", "micro_batches", self.micro_batches, allow_none=False)
        check_positive("pipeline", "dp_size", self.dp_size, allow_none=False)
        check_positive("pipeline", "profile_repeats", self.profile_repeats, allow_none=False)
        if self.link_bandwidth_bytes_per_s < 0 or self.memory_cap_bytes < 0:
            raise ValueError(
                f"pipeline.link_bandwidth_bytes_per_s={self.link_bandwidth_bytes_per_s} and "
                f"pipeline.memory_cap_bytes={self.memory_cap_bytes} must be >= 0"
            )
        if self.profile_warmup < 0 or self.warmup_steps < 0:
            raise ValueError(
                f"pipeline.profile_warmup={self.profile_warmup} and pipeline.warmup_steps={self.warmup_steps} "
                "must be >= 0"
            )
        if self.memory_cap_bytes and self.partition != "exact":
            raise ValueError(
                f"pipeline.memory_cap_bytes={self.memory_cap_bytes:g} needs pipeline.partition='exact', "
                f"not {self.partition!r}"
            )

