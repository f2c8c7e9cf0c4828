"""``comm.codec=auto``: try the codec for a few steps, keep it only if it pays.

Why a trial and not a rule: whether compression pays depends on the link, on the compute it
hides behind and on what the codec costs on this machine's cores, and a lossy codec's step is
worth less than an uncompressed one (PowerSGD needed about 1.2x the steps of plain DDP to reach
its loss on code-lm; ``poise bench network``). Measured step times settle all of it at once:
the steps before compression starts are uncompressed anyway, so the trial costs only the
codec's first ``steps`` steps. When the codec is dropped, error feedback's residuals go out
with the next uncompressed step (``adapter.compressed_hook``): nothing the trial held back is lost.

:class:`CodecTrial` is the decision alone (no process group): it is told each step's seconds
and, once it has both kinds, :meth:`CodecTrial.decide` compares the medians. The session makes
every rank decide the same (:func:`decide_on_every_rank`: each median's maximum over the ranks
first), and the hook asks :meth:`CodecTrial.uses_codec` per step.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_SKIPPED_FIRST_STEPS = 2  # DDP rebuilds its buckets after step 1: those steps say nothing


class CodecTrial:
    """Uncompressed steps before ``start``, the codec's trial steps from ``start`` on, then the
    choice: the codec stays only if ``margin`` times its median step is still below the median
    uncompressed step.

    Args:
        start: the first compressed step (the hook's ``start_step``).
        steps: trial steps of the codec; the first one is not timed (warm starts begin random).
        margin: how much faster per step the codec must be (>= 1; see the module docstring).

    Raises:
        ValueError: ``steps`` < 2, ``margin`` < 1, or ``start`` too early to time an
            uncompressed step.
    """

    def __init__(self, start: int, *, steps: int = 3, margin: float = 1.25) -> None:
        if steps < 2:
            raise ValueError(f"comm.auto_trial_steps={steps} must be >= 2 (the first trial step is not timed)")
        if not margin >= 1.0:
            raise ValueError(f"comm.auto_margin={margin} must be >= 1")
        if start <= _SKIPPED_FIRST_STEPS:
            raise ValueError(f"comm.codec=auto needs uncompressed steps to compare with: start_step={start} must "
                             f"be > {_SKIPPED_FIRST_STEPS} (DDP rebuilds its buckets after step 1)")
        self.start, self.steps, self.margin = start, steps, margin
        self.uncompressed_s: list[float] = []
        self.codec_s: list[float] = []
        self.choice: bool | None = None  # None until decided
        self.decided_from: tuple[float, float] | None = None  # the medians the choice came from

    @property
    def end(self) -> int:
        """The first step after the trial."""
        return self.start + self.steps

    def uses_codec(self, step: int) -> bool:
        """Whether step ``step`` (0-based, optimizer steps) is compressed."""
        if step < self.start:
            return False
        return True if self.choice is None else self.choice

    def observe(self, step: int, step_s: float) -> None:
        """Record step ``step``'s seconds (any step; those outside the windows are ignored)."""
        if self.choice is not None:
            return
        if _SKIPPED_FIRST_STEPS <= step < self.start:
            self.uncompressed_s.append(step_s)
        elif self.start < step < self.end:
            self.codec_s.append(step_s)

    @property
    def ready(self) -> bool:
        """Whether every step of both windows has been observed and no choice made yet."""
        return self.choice is None and len(self.codec_s) == self.steps - 1 and bool(self.uncompressed_s)

    def medians(self) -> tuple[float, float]:
        """(median uncompressed step, median codec step), seconds."""
        return statistics.median(self.uncompressed_s), statistics.median(self.codec_s)

    def decide(self, uncompressed_s: float, codec_s: float) -> bool:
        """Make the choice from the two median steps (seconds; every rank passes the same)."""
        self.choice = codec_s * self.margin < uncompressed_s
        self.decided_from = (uncompressed_s, codec_s)
        return self.choice

    def summary(self) -> dict[str, Any]:
        """For the report: the windows, the medians the choice came from, the choice."""
        medians = self.decided_from or (None, None)
        return {"start_step": self.start, "trial_steps": self.steps, "margin": self.margin,
                "uncompressed_step_s": medians[0], "codec_step_s": medians[1], "uses_codec": self.choice}

    def state_dict(self) -> dict[str, Any]:
        return {"uncompressed_s": list(self.uncompressed_s), "codec_s": list(self.codec_s), "choice": self.choice,
                "decided_from": list(self.decided_from) if self.decided_from else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uncompressed_s = [float(x) for x in state["uncompressed_s"]]
        self.codec_s = [float(x) for x in state["codec_s"]]
        self.choice = state["choice"]
        decided = state.get("decided_from")
        self.decided_from = (float(decided[0]), float(decided[1])) if decided else None


def decide_on_every_rank(trial: CodecTrial) -> bool:
    """Make ``trial``'s choice from the slowest rank's medians (the step waits for it), so that
    every rank chooses the same at the same step. A collective on the default group: call it on
    every rank between steps, once ``trial.ready``."""
    medians = torch.tensor(trial.medians(), dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    uncompressed_s, codec_s = medians.tolist()
    kept = trial.decide(uncompressed_s, codec_s)
    log.info("comm.codec=auto: median step %.0f ms uncompressed, %.0f ms with PowerSGD (x%.2f margin): %s",
             uncompressed_s * 1e3, codec_s * 1e3, trial.margin, "PowerSGD kept" if kept else "uncompressed from now on")
    return kept
