"""``[train]``: how long and how hard to train."""

from __future__ import annotations

import re
from dataclasses import dataclass

from poise.config.fields import check_finite, check_positive, setting

# Upper bounds of the counts below: far beyond any run, and small enough that every loop,
# schedule and RNG seeded from them works. Workers seed numpy with ``seed * 1000 + rank``
# (poise/train/recipe.py), which numpy takes in 0..2^32-1: 2^22 - 1 leaves room for 10^8 ranks.
MAX_SEED = 2**22 - 1
MAX_STEPS = 10**9
# AdamW's peak learning rate: runs use 1e-4..1e-2; past 10 every update overflows or diverges
# at once (1e308 was accepted and the run died at its first step)
MAX_LR = 10.0
# train.frozen: comma-separated parameter-name prefixes (dotted names: "blocks.0,token_embedding")
MAX_FROZEN_CHARS = 4096
_PREFIX = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.?$")
_MAXIMA = {"steps": MAX_STEPS, "epochs": 10**6, "batch_size": 10**6, "batch_tokens": 10**9,
           "schedule_steps": MAX_STEPS, "warmup_steps": MAX_STEPS, "eval_every": MAX_STEPS, "accum_steps": 10**4}


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How long and how hard to train."""

    steps: int | None = setting(None, "optimizer steps to run (default 100 unless epochs is set)")
    epochs: int | None = setting(None, "full passes over the training split (instead of steps)")
    batch_size: int | None = setting(None, "samples per rank per step (default: the task's)")
    batch_tokens: int | None = setting(
        None, "code-lm: per-rank token budget per step, padded tokens counted (instead of batch_size)"
    )
    lr: float | None = setting(None, "peak learning rate of AdamW (default: the task's)")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    warmup_steps: int = setting(10, "linear learning-rate warm-up, then cosine decay to 10%")
    schedule_steps: int | None = setting(
        None, "optimizer steps the learning-rate schedule spans while gradients go exact (default: the whole "
        "run; its cosine reaches 10% there and stays); a lossy codec, or auto keeping PowerSGD, spans the whole "
        "run, as its steps are worth less (poise bench network gives them extra steps)"
    )
    grad_clip_norm: float = setting(1.0, "clip the global gradient norm to this (0 = off)")
    seed: int = setting(0, "seed for the model, data order and every rank's RNG")
    accum_steps: int = setting(
        1, "micro-batches per optimizer step (gradient accumulation); --checkpoint-every, --fail-at count micro-batches"
    )
    frozen: str = setting(
        "", "parameter-name prefixes kept fixed, comma-separated (fine-tuning), e.g. 'blocks.0,token_embedding'"
    )
    eval_every: int = setting(
        0, "evaluate every N optimizer steps too, not only at the end (0: at the end only); the report's "
        "eval_curve gives each evaluation's loss against the training seconds so far (time to accuracy)"
    )
    stop_at_eval_loss: float | None = setting(
        None, "stop once an evaluation (train.eval_every) reaches this eval loss (the task's unit; the "
        "learning-rate schedule still spans the whole run)"
    )

    def frozen_prefixes(self) -> tuple[str, ...]:
        """``frozen`` parsed: the parameter-name prefixes kept fixed."""
        return tuple(p.strip() for p in self.frozen.split(",") if p.strip())

    def _check_frozen(self) -> None:
        """``frozen`` as the command reads it, before any worker builds the model: bounded, and
        every prefix a dotted parameter name (whether it names one of the model's parameters is
        checked against the model, :func:`poise.train.recipe.freeze`).

        Raises:
            ValueError: one line, quoting at most the value's first 60 characters.
        """
        shown = f"{self.frozen[:60]!r}{'...' if len(self.frozen) > 60 else ''}"
        if len(self.frozen) > MAX_FROZEN_CHARS:
            raise ValueError(f"train.frozen={shown} is invalid: {len(self.frozen)} characters, allowed is at most "
                             f"{MAX_FROZEN_CHARS} (comma-separated parameter-name prefixes)")
        bad = [p for p in self.frozen_prefixes() if not _PREFIX.match(p)]
        if bad:
            raise ValueError(f"train.frozen={shown} is invalid: {bad[0][:60]!r} is not a parameter-name prefix "
                             "(dotted names of letters, digits and _, e.g. 'blocks.0,token_embedding')")

    def __post_init__(self) -> None:
        check_finite("train", self)
        for name in ("steps", "epochs", "batch_size", "batch_tokens", "lr", "schedule_steps"):
            check_positive("train", name, getattr(self, name))
        check_positive("train", "accum_steps", self.accum_steps, allow_none=False)
        for name, most in _MAXIMA.items():
            value = getattr(self, name)
            if value is not None and value > most:
                raise ValueError(f"train.{name}={value} is invalid: allowed is at most {most}")
        if isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"train.seed={self.seed} is invalid: allowed is 0..{MAX_SEED}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError(
                f"train.steps={self.steps} and train.epochs={self.epochs} are both set: give one"
            )
        if self.batch_size is not None and self.batch_tokens is not None:
            raise ValueError(
                f"train.batch_size={self.batch_size} and train.batch_tokens={self.batch_tokens} "
                "are both set: give one"
            )
        if self.lr is not None and self.lr > MAX_LR:
            raise ValueError(f"train.lr={self.lr:g} is invalid: allowed is above 0 and at most {MAX_LR:g} "
                             "(AdamW's peak learning rate; runs use 1e-4..1e-2)")
        self._check_frozen()
        if self.weight_decay < 0 or self.warmup_steps < 0 or self.grad_clip_norm < 0:
            raise ValueError("train.weight_decay, train.warmup_steps and train.grad_clip_norm must be >= 0")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every} must be >= 0 (0: evaluate at the end only)")
        if self.stop_at_eval_loss is not None and not self.eval_every:
            raise ValueError(f"train.stop_at_eval_loss={self.stop_at_eval_loss} needs train.eval_every > 0: "
                             "the loss is checked at those evaluations")

