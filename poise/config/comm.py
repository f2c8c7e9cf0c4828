"""``[comm]``: how gradients are communicated. Codec and collective names are checked against
their registries by ``poise.comm.registry.check``; here only ranges and formats."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How gradients are communicated: the DDP communication hook and its codec."""

    codec: str | None = setting(
        None, "gradient codec: none = exact (torch-fp16 and torch-powersgd: torch's own hooks, for comparison); "
        "unset: poise decides, exact on one node and auto across nodes (docs/decide.md)"
    )
    error_feedback: bool = setting(True, "add each bucket's compression error back into the next step")
    topk_ratio: float = setting(0.01, "topk/randomk: share of gradient entries sent, in (0, 1]")
    powersgd_rank: int = setting(8, "powersgd: rank of the approximation (code-lm: rank 4 costs 2.9%, 8 costs 1.5%)")
    int8_chunk_size: int = setting(1024, "int8: entries per scale (one fp32 scale per chunk)")
    auto_trial_steps: int = setting(
        3, "auto: PowerSGD dry runs, after each of the last uncompressed steps before start_step (the first "
           "untimed): its reduction once more, result thrown away, so a dropped codec changes nothing"
    )
    auto_margin: float = setting(
        1.25, "auto: use PowerSGD only if its predicted step times this is still below the uncompressed one "
        "(a lossy step is worth less: PowerSGD needed ~1.2x DDP's steps to reach its loss on code-lm)"
    )
    start_step: int | None = setting(
        None, "optimizer steps run uncompressed first (unset: 2, as DDP rebuilds its buckets after step 1; for "
        "a lossy codec or a frozen variance: a twentieth of the run and at least twice the learning-rate warm-up)"
    )
    local_first: bool = setting(
        False, "each rank applies its own gradient whole at once; error feedback then delays only what the "
        "other ranks send (ranks' weights differ by their unsent residuals; see poise/comm/wrappers.py)"
    )
    on_nonfinite: str = setting("error", "NaN/Inf in a gradient: 'error' stops, 'skip' skips the step and logs")
    freeze_variance: str = setting(
        "auto", "freeze AdamW's second moment once compression starts (1-bit Adam; see poise/train/optim.py): "
        "on, off, or auto (on for the codecs whose payload gives every entry one magnitude, such as sign)"
    )
    collective: str = setting(
        "flat", "all-reduce algorithm (flat = the backend's own; hierarchical compresses only between nodes; "
        "auto: see poise/comm/collectives/auto.py)"
    )
    segment_bytes: int = setting(1 << 20, "ring and hierarchical: pipeline segment, in bytes")
    tree_max_bytes: int = setting(64 << 10, "auto: messages up to this many bytes use the tree (recursive doubling)")
    bucket_mb: float = setting(
        25.0, "DDP gradient bucket size in MB (2**20 bytes): smaller buckets start communicating earlier in "
        "backward, larger ones send fewer messages"
    )

    @property
    def exact(self) -> bool:
        """Whether gradients go exact: ``none``, or no codec named (poise's to decide in a session,
        ``poise/decide/policy.py``; exact where nothing decides, e.g. a strategy built on its own)."""
        return self.codec in (None, "none")

    def __post_init__(self) -> None:
        check_finite("comm", self)
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ValueError(f"comm.topk_ratio={self.topk_ratio} is outside (0, 1]")
        check_positive("comm", "powersgd_rank", self.powersgd_rank, allow_none=False)
        check_positive("comm", "int8_chunk_size", self.int8_chunk_size, allow_none=False)
        if self.auto_trial_steps < 2:
            raise ValueError(f"comm.auto_trial_steps={self.auto_trial_steps} must be >= 2 "
                             "(the first dry run is not timed)")
        if not self.auto_margin >= 1.0:
            raise ValueError(f"comm.auto_margin={self.auto_margin} must be >= 1")
        if self.start_step is not None and self.start_step < 0:
            raise ValueError(f"comm.start_step={self.start_step} must be >= 0")
        check_positive("comm", "bucket_mb", self.bucket_mb, allow_none=False)
        if self.on_nonfinite not in ("error", "skip"):
            raise ValueError(f"comm.on_nonfinite={self.on_nonfinite!r} is unknown: allowed are error, skip")
        if self.freeze_variance not in ("auto", "on", "off"):
            raise ValueError(f"comm.freeze_variance={self.freeze_variance!r} is unknown: allowed are auto, on, off")
        check_positive("comm", "segment_bytes", self.segment_bytes, allow_none=False)
        check_positive("comm", "tree_max_bytes", self.tree_max_bytes, allow_none=False)
