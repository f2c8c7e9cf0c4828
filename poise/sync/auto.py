"""``sync.mode=auto``: the trial that times DDP's steps and then fully synchronized ones, and
the choice it makes (every step synchronized, or outer steps every H inner steps), for
:class:`poise.sync.outer.Outer`.

``auto`` measures before it chooses. Its first ``auto_trial_steps`` steps are DDP's (they count
as the warm-up): the probe splits each into compute and the communication backward waited for
after its last bucket (DDP overlaps the rest with backward). If that exposed communication is
at most ``auto_max_overhead`` of the step's compute, every step keeps synchronizing (plain DDP
through ``[comm]``: on a fast link outer steps could only lose accuracy). Otherwise as many
steps again synchronize in full after each (local SGD with H=1, the outer step's own collective
and codec, timed blocking) and it takes outer steps with the fewest inner steps H that keep
``sync_s / (H compute_s)`` within that share (at most a tenth of the steps left), DiLoCo's
Nesterov step if that leaves ``AUTO_DILOCO_ROUNDS`` rounds or more, plain averaging for fewer
(momentum needs rounds to pay). The choice and its figures go into the report (``sync`` key).

:func:`per_step_pays` and :func:`choose_inner_steps` are the pure choices; :class:`AutoTrial`
keeps the timings and makes every rank decide alike, from the ranks' mean of their medians.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from poise.config import SyncConfig

log = logging.getLogger(__name__)

# auto never picks fewer inner steps than this for an outer mode, nor more than the cap
AUTO_MIN_INNER, AUTO_MAX_INNER = 2, 500
# auto's outer step is DiLoCo's (Nesterov) from this many rounds left, else plain averaging
AUTO_DILOCO_ROUNDS = 50


def per_step_pays(exposed_s: float, compute_s: float, max_overhead: float) -> bool:
    """``auto``'s first question: whether DDP's exposed communication (seconds a step that
    backward waited for its all-reduce after computing its last bucket) is at most
    ``max_overhead`` of a step's compute seconds. Then no outer step can save more than that
    share, and every outer step costs accuracy: per-step synchronization stays."""
    return compute_s <= 0 or exposed_s <= max_overhead * compute_s


def choose_inner_steps(sync_s: float, compute_s: float, max_overhead: float, steps_left: int | None = None) -> int:
    """``auto``'s H: 1 (synchronize every step) when one synchronization costs at most
    ``max_overhead`` of a step's compute, else the fewest inner steps that keep it there, and
    at most a tenth of the ``steps_left`` (if known): DiLoCo needs rounds to converge."""
    if compute_s <= 0 or sync_s <= max_overhead * compute_s:
        return 1
    cap = AUTO_MAX_INNER if steps_left is None else max(AUTO_MIN_INNER, min(AUTO_MAX_INNER, steps_left // 10))
    return max(AUTO_MIN_INNER, min(cap, math.ceil(sync_s / (max_overhead * compute_s))))


class AutoTrial:
    """``auto``'s timings on this rank and the choice every rank makes from them (see module doc).

    :class:`~poise.sync.outer.Outer` times the steps and applies the choice; this object only
    collects the seconds and decides, once a phase's ``auto_trial_steps`` are in (a collective:
    every rank reaches it at the same step).

    Args:
        config: the ``[sync]`` settings (``auto_trial_steps``, ``auto_max_overhead``).
        world_size: ranks in the default group.
        device: where the all-reduce of the medians runs (NCCL reduces only device tensors).

    Attributes:
        choice: None until decided; then ``{"mode": "step" | "diloco" | "local_sgd",
            "inner_steps": H, "ddp_compute_s", "ddp_exposed_s", ..., "why"}`` (seconds).
    """

    def __init__(self, config: SyncConfig, world_size: int, device: torch.device) -> None:
        self.config, self.world_size, self.device = config, world_size, device
        self.choice: dict[str, Any] | None = None
        self.ddp: list[tuple[float, float]] = []  # (compute s, exposed communication s) of DDP's steps
        self.outer: list[tuple[float, float]] = []  # (compute s, sync s) of each fully synchronized step
        self.ddp_figures: tuple[float, float] | None = None  # DDP's median (compute s, exposed s), all ranks

    @property
    def timing_ddp(self) -> bool:
        """Whether DDP's steps are still being timed (no first decision yet)."""
        return self.ddp_figures is None

    def ddp_step(self, compute_s: float, exposed_s: float) -> bool:
        """One of DDP's steps took ``compute_s`` of compute and left ``exposed_s`` of communication
        exposed; after the last, every rank takes the same first decision. Returns whether it
        chose per-step synchronization (False: outer steps are timed next, or still timing)."""
        self.ddp.append((compute_s, exposed_s))
        if len(self.ddp) < self.config.auto_trial_steps:
            return False
        compute_s, exposed_s = _agreed_medians(self.ddp[1:], self.world_size, self.device)  # DDP's first
        self.ddp_figures = (compute_s, exposed_s)  # step rebuilds its buckets: not timed
        if not per_step_pays(exposed_s, compute_s, self.config.auto_max_overhead):
            return False  # outer steps: their own synchronization is timed after the warm-up
        self._choose("step", 1, f"DDP's all-reduce left {exposed_s:.3f} s a step exposed against {compute_s:.3f} s "
                                f"of compute ({_share(exposed_s, compute_s):.1%} <= "
                                f"{self.config.auto_max_overhead:.0%}): every step synchronizes, exactly")
        return True

    def synchronized_step(self, compute_s: float, sync_s: float, left: int | None) -> dict[str, Any] | None:
        """After DDP's steps left too much exposed: one fully synchronized step took ``compute_s``
        of compute and ``sync_s`` to synchronize; after the last, every rank chooses H alike
        (``left``: optimizer steps still to run, None if unknown). Returns the choice, once made."""
        self.outer.append((compute_s, sync_s))
        if len(self.outer) < self.config.auto_trial_steps:
            return None
        compute_s, sync_s = _agreed_medians(self.outer[1:], self.world_size, self.device)  # the first
        ddp = ""  # warms up the collective; (no DDP figures: resumed from an older poise's checkpoint)
        if self.ddp_figures is not None:
            ddp_compute_s, exposed_s = self.ddp_figures
            ddp = (f"DDP's all-reduce left {exposed_s:.3f} s a step exposed against {ddp_compute_s:.3f} s of "
                   f"compute ({_share(exposed_s, ddp_compute_s):.0%} > {self.config.auto_max_overhead:.0%}); ")
        h = choose_inner_steps(sync_s, compute_s, self.config.auto_max_overhead, left)
        overhead = _share(sync_s, compute_s)
        if h == 1:
            return self._choose("step", 1, ddp + f"one blocking synchronization takes {sync_s:.3f} s against "
                                                 f"{compute_s:.3f} s of compute ({overhead:.1%}): every step "
                                                 "synchronizes, exactly")
        # Nesterov's outer momentum pays over many rounds; over few, plain averaging did better
        # (code-lm, 4 workers, 100 steps: eval 2.98 at H=10 against DiLoCo's 3.21)
        rounds = left // h if left is not None else None
        diloco = rounds is None or rounds >= AUTO_DILOCO_ROUNDS
        outer = "DiLoCo" if diloco else f"parameter averaging (local SGD: {rounds} rounds, < {AUTO_DILOCO_ROUNDS})"
        return self._choose("diloco" if diloco else "local_sgd", h, ddp + (
            f"one blocking synchronization takes {sync_s:.3f} s against {compute_s:.3f} s of compute a step: {outer} "
            f"every {h} steps keeps it to {overhead / h:.1%} of compute"
            + ("" if left is None or h < left // 10 else f" (at most a tenth of the {left} steps left)")),
            compute_s=compute_s, sync_s=sync_s)

    def _choose(self, mode: str, h: int, why: str, **figures: float) -> dict[str, Any]:
        compute_s, exposed_s = self.ddp_figures or (0.0, 0.0)
        self.choice = {"mode": mode, "inner_steps": h, "ddp_compute_s": compute_s, "ddp_exposed_s": exposed_s,
                       **figures, "why": why}
        log.info("sync auto: %s", why)
        return self.choice

    def state_dict(self) -> dict[str, Any]:
        """The timings so far (the choice is saved beside them, under the outer state's ``choice``)."""
        return {"ddp": list(self.ddp), "outer": list(self.outer), "ddp_figures": self.ddp_figures}

    def load_state_dict(self, state: dict[str, Any], choice: dict[str, Any] | None) -> None:
        """From :meth:`state_dict` (empty: an older poise's checkpoint had no timings) and the saved ``choice``."""
        self.choice = choice
        self.ddp = [(float(a), float(b)) for a, b in state.get("ddp", [])]
        self.outer = [(float(a), float(b)) for a, b in state.get("outer", [])]
        figures = state.get("ddp_figures")
        self.ddp_figures = (float(figures[0]), float(figures[1])) if figures is not None else None


def _agreed_medians(timed: Sequence[tuple[float, float]], world_size: int,
                    device: torch.device) -> tuple[float, float]:
    """The ranks' mean of this rank's medians of each figure (seconds): every rank decides alike."""
    mine = torch.tensor([statistics.median(t[0] for t in timed), statistics.median(t[1] for t in timed)],
                        dtype=torch.float64, device=device)
    dist.all_reduce(mine)
    return float(mine[0]) / world_size, float(mine[1]) / world_size


def _share(part_s: float, whole_s: float) -> float:
    """``part_s / whole_s``, 0 when the whole is no time (a share, not seconds)."""
    return part_s / whole_s if whole_s > 0 else 0.0


__all__ = ["AUTO_DILOCO_ROUNDS", "AUTO_MAX_INNER", "AUTO_MIN_INNER", "AutoTrial", "choose_inner_steps",
           "per_step_pays"]
