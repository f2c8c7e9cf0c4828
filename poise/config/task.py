"""``[task]``: what is trained, the task and its model size."""

from __future__ import annotations

from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting

TASK_NAMES = ("code-lm", "digits")
# The largest model settings accepted: every worker builds the model, so a width of 10^9 would
# fail only there, on every rank, out of memory.
_MAXIMA = {"max_seq_len": 1 << 20, "d_model": 1 << 16, "num_layers": 1024, "num_heads": 1024}


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What is trained: the task and its model size."""

    name: str = setting("code-lm", f"task to train: {', '.join(TASK_NAMES)}")
    max_seq_len: int = setting(1024, "code-lm: samples are truncated to this many bytes")
    packed: bool = setting(
        False, "code-lm: train on whole documents packed into rows of max_seq_len bytes, attention per document "
        "(longer documents are cut into pieces of a row); train.batch_size counts rows per rank per step, and "
        "balance auto/cost/dynamic decides which documents go in which row on which rank (static: rows filled in "
        "order, equal rows per rank)"
    )
    d_model: int = setting(128, "code-lm: transformer width")
    num_layers: int = setting(2, "code-lm: transformer blocks")
    num_heads: int = setting(4, "code-lm: attention heads (must divide d_model)")
    eval_max_samples: int = setting(
        512, "held-out samples evaluated at the end (0 = all of the held-out split)"
    )
    cache_dir: str = setting("", "where the code-lm corpus index and the digits split are cached ('' = ~/.cache/poise)")

    def __post_init__(self) -> None:
        check_finite("task", self)
        if self.name not in TASK_NAMES:
            raise ValueError(f"task.name={self.name!r} is unknown: allowed are {', '.join(TASK_NAMES)}")
        for name in ("max_seq_len", "d_model", "num_layers", "num_heads"):
            check_positive("task", name, getattr(self, name), allow_none=False)
            if getattr(self, name) > _MAXIMA[name]:
                raise ValueError(f"task.{name}={getattr(self, name)} is invalid: allowed is at most {_MAXIMA[name]}")
        if self.max_seq_len < 16:
            raise ValueError(f"task.max_seq_len={self.max_seq_len} is too small: it must be >= 16")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"task.d_model={self.d_model} is not divisible by task.num_heads={self.num_heads}"
            )
        if self.packed and self.name != "code-lm":
            raise ValueError(f"task.packed=true packs documents of code-lm, not of task {self.name!r}")
        if self.eval_max_samples < 0:
            raise ValueError(f"task.eval_max_samples={self.eval_max_samples} must be >= 0")

