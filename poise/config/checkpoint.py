"""``[checkpoint]``: checkpoints and resuming (see poise/checkpoint/). Which codecs may write
deltas is the codec registry's to say (``poise.comm.registry.check``)."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints and resuming (see poise/checkpoint/)."""

    every_steps: int = setting(0, "save a checkpoint every this many steps, and at the end (0 = never)")
    dir: str = setting("", "checkpoint directory ('' = <out_dir>/checkpoints)")
    resume: bool = setting(False, "start from the newest good checkpoint in dir (it must exist)")
    async_save: bool = setting(True, "write checkpoints in the background while training continues")
    differential: bool = setting(True, "between full saves, write only the tensors that changed (exact, by hash)")
    full_every: int = setting(10, "differential: every this many saves is a full one")
    delta_codec: str = setting(
        "exact", "differential: 'exact' writes changed tensors whole; a codec that decodes from its payload alone "
        "(e.g. int8) writes their change since the last save, with its error carried to the next (restore within "
        "the logged error)")
    keep: int = setting(3, "newest checkpoints kept (plus the full bases they build on)")

    def __post_init__(self) -> None:
        check_finite("checkpoint", self)
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps={self.every_steps} must be >= 0 (0 = no checkpoints)")
        check_positive("checkpoint", "full_every", self.full_every, allow_none=False)
        check_positive("checkpoint", "keep", self.keep, allow_none=False)
