"""``comm.codec=auto``: decide whether PowerSGD pays before it touches a single gradient.

Why a measurement and not a rule: whether compression pays depends on the link, on the
compute it hides behind and on what the codec costs on this machine's cores. Why a *dry run*
and not a trial of real compressed steps: a lossy step early in training costs accuracy even
when the codec is dropped afterwards (over 10 Gbit/s a 3-step trial left the eval loss 0.5 %
above plain DDP's after 200 steps, and a dropped codec could never reach DDP's loss in DDP's
time). So the steps before ``start`` stay uncompressed and exact; after each of the last
``steps`` of them, every rank runs the codec's whole reduction once more on that step's
gradient buckets, outside the step, result and codec state thrown away. Nothing the model sees
changes: a dropped codec leaves the run bit-identical to plain DDP.

The prediction: a compressed step costs the uncompressed step without its exposed
communication (``step_s - comm_wait_s``, the compute, data and optimizer) plus the dry run's
seconds (the codec's encoding, its collectives and its decoding, none of it hidden behind
backward: pessimistic, as PowerSGD's encoding runs on the autograd thread anyway). The codec is
kept only if ``margin`` times that is still below the uncompressed step: a lossy step is worth
less (PowerSGD needed about 1.2x plain DDP's steps to reach its loss on code-lm).

The prediction is then checked: a kept codec's first ``confirm_steps`` compressed steps after
the first (which allocates the codec's buffers) are timed, and if ``margin`` times their
median is not below the uncompressed step after all, the codec is dropped and every later step
is exact again. Do no harm: a lossy codec stays only while its measured steps pay for it.

:class:`CodecTrial` is the decision alone (no process group): it is told each step's seconds
and each dry run's. The hook state runs the dry runs (``adapter.HookState.between_steps``) and
:func:`decide_on_every_rank` makes every rank decide the same, from the slowest rank's medians.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_SKIPPED_FIRST_STEPS = 2  # DDP rebuilds its buckets after step 1: those steps say nothing


def earliest_start(steps: int) -> int:
    """The first step that may be compressed with ``steps`` dry runs: they follow uncompressed
    steps past DDP's bucket rebuild."""
    return steps + _SKIPPED_FIRST_STEPS


class CodecTrial:
    """Times uncompressed steps from step 2 to ``start``, dry-runs the codec after each of the
    last ``steps`` of them, then chooses once: from ``start`` on, the codec is used only if
    ``margin`` times the predicted compressed step is below the median uncompressed step.

    Args:
        start: the first step that may be compressed (the hook's ``start_step``).
        steps: dry runs, after steps ``start - steps`` to ``start - 1``; the first is not timed
            (it allocates the codec's buffers).
        margin: how much faster per step the codec must be (>= 1; see the module docstring).
        confirm_steps: compressed steps timed, after the first, to confirm a kept codec (see
            the module docstring); 0: never checked.

    Raises:
        ValueError: ``steps`` < 2, ``margin`` < 1, ``confirm_steps`` < 0, or ``start`` too early
            for the dry runs.
    """

    def __init__(self, start: int, *, steps: int = 3, margin: float = 1.25, confirm_steps: int = 3) -> None:
        if steps < 2:
            raise ValueError(f"comm.auto_trial_steps={steps} must be >= 2 (the first dry run is not timed)")
        if not margin >= 1.0:
            raise ValueError(f"comm.auto_margin={margin} must be >= 1")
        if confirm_steps < 0:
            raise ValueError(f"confirm_steps={confirm_steps} must be >= 0")
        if start < earliest_start(steps):
            raise ValueError(f"comm.codec=auto dry-runs the codec after the {steps} uncompressed steps before "
                             f"start_step: start_step={start} must be >= {earliest_start(steps)} "
                             f"(comm.auto_trial_steps + {_SKIPPED_FIRST_STEPS}: DDP rebuilds its buckets after step 1)")
        self.start, self.steps, self.margin, self.confirm_steps = start, steps, margin, confirm_steps
        self.uncompressed_s: list[float] = []  # step seconds of the uncompressed steps
        self.compute_s: list[float] = []  # ... without their exposed communication
        self.dry_run_s: list[float] = []  # the timed dry runs
        self.choice: bool | None = None  # None until decided
        self.decided_from: tuple[float, float] | None = None  # (uncompressed step, predicted codec step)
        self.compressed_s: list[float] = []  # step seconds of the compressed steps timed to confirm
        self.confirmed: bool | None = None  # None until the compressed steps are in (or never kept)
        self.measured_s: float | None = None  # the slowest rank's median compressed step, seconds
        self.dropped_step: int | None = None  # the first exact step again, where the codec did not pay

    def dry_run_due(self, step: int) -> bool:
        """Whether the hook keeps step ``step``'s buckets for a dry run after it."""
        return self.choice is None and self.start - self.steps <= step < self.start

    def uses_codec(self, step: int) -> bool:
        """Whether step ``step`` (0-based, optimizer steps) is compressed: never before the choice,
        nor once the compressed steps did not confirm it."""
        return self.start <= step and bool(self.choice) and (self.dropped_step is None or step < self.dropped_step)

    def observe(self, step: int, step_s: float, comm_wait_s: float) -> None:
        """Record a step's seconds and the part of them spent waiting for the reduction (any
        step: uncompressed ones before the choice, compressed ones while confirming, the others
        ignored)."""
        if self.choice is None and _SKIPPED_FIRST_STEPS <= step < self.start:
            self.uncompressed_s.append(step_s)
            self.compute_s.append(max(0.0, step_s - comm_wait_s))
        elif (self.choice and self.confirmed is None and step > self.start
              and len(self.compressed_s) < self.confirm_steps):
            self.compressed_s.append(step_s)

    @property
    def confirm_ready(self) -> bool:
        """Whether a kept codec's timed compressed steps are all in, and not yet judged."""
        return (bool(self.choice) and self.confirmed is None and self.confirm_steps > 0
                and len(self.compressed_s) == self.confirm_steps)

    def confirm(self, uncompressed_s: float, measured_s: float, next_step: int) -> bool:
        """Judge a kept codec by its measured steps (the median compressed step, seconds, every
        rank passing the same): kept while ``margin`` times it is below ``uncompressed_s``, else
        dropped from ``next_step`` on. Returns whether it is kept."""
        self.measured_s = measured_s
        self.confirmed = measured_s * self.margin < uncompressed_s
        if not self.confirmed:
            self.dropped_step = next_step
        return self.confirmed

    def observe_dry_run(self, step: int, seconds: float) -> None:
        """Record the dry run after step ``step`` (the first one is not timed)."""
        if self.choice is None and self.start - self.steps < step < self.start:
            self.dry_run_s.append(seconds)

    @property
    def ready(self) -> bool:
        """Whether every timed dry run and an uncompressed step are in, and no choice made yet."""
        return self.choice is None and len(self.dry_run_s) == self.steps - 1 and bool(self.uncompressed_s)

    def medians(self) -> tuple[float, float, float]:
        """(uncompressed step, its compute without exposed communication, dry run), seconds."""
        return (statistics.median(self.uncompressed_s), statistics.median(self.compute_s),
                statistics.median(self.dry_run_s))

    def decide(self, uncompressed_s: float, compute_s: float, dry_run_s: float) -> bool:
        """Make the choice from the medians (seconds; every rank passes the same)."""
        predicted_s = compute_s + dry_run_s
        self.choice = predicted_s * self.margin < uncompressed_s
        self.decided_from = (uncompressed_s, predicted_s)
        return self.choice

    def summary(self) -> dict[str, Any]:
        """For the report: the window, the step times the choice came from, the choice."""
        medians = self.decided_from or (None, None)
        return {"start_step": self.start, "trial_steps": self.steps, "margin": self.margin,
                "uncompressed_step_s": medians[0], "codec_step_s": medians[1], "uses_codec": self.choice,
                "confirm_steps": self.confirm_steps, "measured_codec_step_s": self.measured_s,
                "confirmed": self.confirmed, "dropped_step": self.dropped_step}

    def state_dict(self) -> dict[str, Any]:
        return {"uncompressed_s": list(self.uncompressed_s), "compute_s": list(self.compute_s),
                "dry_run_s": list(self.dry_run_s), "choice": self.choice,
                "decided_from": list(self.decided_from) if self.decided_from else None,
                "compressed_s": list(self.compressed_s), "confirmed": self.confirmed, "measured_s": self.measured_s,
                "dropped_step": self.dropped_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.uncompressed_s = [float(x) for x in state.get("uncompressed_s", [])]
        self.compute_s = [float(x) for x in state.get("compute_s", [])]
        self.dry_run_s = [float(x) for x in state.get("dry_run_s", [])]
        choice = state.get("choice")
        if choice is not None and not isinstance(choice, bool):
            raise ValueError(f"comm trial state: choice={choice!r} must be true, false or null")
        self.choice = choice
        decided = state.get("decided_from")
        self.decided_from = (float(decided[0]), float(decided[1])) if decided else None
        self.compressed_s = [float(x) for x in state.get("compressed_s", [])]
        confirmed = state.get("confirmed")
        if confirmed is not None and not isinstance(confirmed, bool):
            raise ValueError(f"comm trial state: confirmed={confirmed!r} must be true, false or null")
        self.confirmed = confirmed
        measured, dropped = state.get("measured_s"), state.get("dropped_step")
        self.measured_s = float(measured) if measured is not None else None
        self.dropped_step = int(dropped) if dropped is not None else None


def _slowest(seconds: tuple[float, ...]) -> list[float]:
    """Each of ``seconds`` as the slowest rank measured it (the step waits for that rank): a
    MAX all-reduce on the default group, so that every rank decides from the same figures."""
    figures = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return figures.tolist()


def decide_on_every_rank(trial: CodecTrial) -> bool:
    """Make ``trial``'s choice from the slowest rank's medians (the step waits for it), so that
    every rank chooses the same at the same step. A collective on the default group: call it on
    every rank between steps, once ``trial.ready``."""
    uncompressed_s, compute_s, dry_run_s = _slowest(trial.medians())
    kept = trial.decide(uncompressed_s, compute_s, dry_run_s)
    log.info("comm.codec=auto: median step %.0f ms uncompressed, %.0f ms predicted with PowerSGD (%.0f ms without "
             "exposed communication + a %.0f ms dry run; x%.2f margin): %s", uncompressed_s * 1e3,
             (compute_s + dry_run_s) * 1e3, compute_s * 1e3, dry_run_s * 1e3, trial.margin,
             f"PowerSGD from step {trial.start}" if kept else "uncompressed, as plain DDP")
    return kept


def confirm_on_every_rank(trial: CodecTrial, next_step: int) -> bool:
    """Judge ``trial``'s kept codec by the slowest rank's median compressed step against its
    median uncompressed one, so that every rank keeps or drops it at the same step. A collective
    on the default group: call it on every rank between steps, once ``trial.confirm_ready``."""
    uncompressed_s, measured_s = _slowest((statistics.median(trial.uncompressed_s),
                                           statistics.median(trial.compressed_s)))
    kept = trial.confirm(uncompressed_s, measured_s, next_step)
    log.info("comm.codec=auto: median step %.0f ms with PowerSGD over %d steps, %.0f ms uncompressed (x%.2f "
             "margin): %s", measured_s * 1e3, len(trial.compressed_s), uncompressed_s * 1e3, trial.margin,
             "kept" if kept else f"dropped, exact again from step {next_step}")
    return kept
