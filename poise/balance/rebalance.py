"""Re-measuring rank speeds while training and re-planning the split (the seed's DynamicPartitioner).

Every rank records, per step, the padded cost terms of its own batch (n·Lmax and n·Lmax²)
and its own compute seconds (from the timeline's probe, so waiting for others is excluded).
At re-plan steps the ranks exchange their records since the last change of speed (at most
``HISTORY_STEPS``) with one small all-gather, and every rank then computes the same thing
from the same numbers:

1. α of the cost L + α·L² refitted (when ``fit_alpha``) for every rank from all those steps,
   in relative error (:func:`~poise.balance.costs.fit_alpha`); the median over ranks groups
   and budgets the steps and splits them, unless each rank's own α makes the per-step speeds
   steadier by ``1 - PRECISER`` (:func:`~poise.balance.speeds.speed_scatter`): then each rank's own α splits them
   (a rank throttled by a CPU quota measured up to 4x the α of its unthrottled peer: it
   loses more on long samples). α is a property of the device and the model, and a 20-step
   window of code-lm holds few steps of short samples, so its fits swung by 10x from one
   re-plan to the next;
2. a change of speed: when the last ``RECENT_STEPS`` steps of some rank differ from the rest of
   the last ``window_steps`` by more than ``CHANGE_Z`` standard errors (and by more than
   10 %), relative to the other ranks in the same steps, the older steps describe a device
   that is gone, and every rank drops them, keeping the steps since the most likely step of
   the change (:func:`~poise.balance.speeds.estimate_speeds`, :func:`~poise.balance.speeds.change_point`);
3. each rank's speed over the last ``window_steps`` steps (in its own cost units): the
   geometric mean of the per-step speeds (:func:`~poise.balance.costs.measured_speeds`), and
   its relative standard error from the spread of its per-step speed relative to the other
   ranks' in the same step (what the whole machine or a step's lengths do to every rank
   cancels: it does not move the shares);
4. the new shares (:func:`~poise.balance.speeds.choose_shares`): none when the move would be within the
   measurement's own noise (two standard errors); straight to the shares proportional to
   speed when every rank's estimate is confident (relative error ≤ ``confident_error``);
   otherwise the seed's damping, each share moved by at most ``max_share_change``, or, when
   it lands closer to the target, the near edge of the target's two-standard-error band;
5. the sampler splits the following steps with the new shares.

Why not only the damping: with a re-plan every 50 steps and 15 % per re-plan, a 2x slower
rank took about 110 steps to be balanced (whole-run balance 0.74 over 150 steps). A
confident measurement says where the target is; moving there at once is a fixed-point
iteration that equalises compute times in one or two re-plans (a share's cost/time ratio
changes little with the share). The damping is kept for what it is good at: estimates that
are still noisy.

Confirmation (``confirm_steps``, balance ``auto``'s do-no-harm): a move is a prediction that
the steps will be better balanced. For ``confirm_steps`` steps after it the shares stay put,
then the measured balance of those steps (the median over them of each step's mean over max
of the ranks' compute seconds, :func:`~poise.balance.speeds.move_confirmed`) is compared with that of as many steps
before it; when it fell by more than ``CONFIRM_MARGIN``, the move is undone (decision
``revert``: the shares go back) and no move is made again until the speeds change or a
window of steps has passed. A move that does what it predicted is kept (``confirm``).

Schedule: the first ``cold_start_steps`` steps run on the equal split (the first step of a
process is left out of the window: it pays for DDP's bucket rebuild and lazy allocations),
the first re-plan happens right after them, and then every ``replan_every_steps`` steps. The
cold start is the seed's guard against acting on a few noisy early steps; a measurement that
is already confident does not need it. So the re-planner also looks every
``replan_every_steps`` steps during the cold start, and moves only when the decision is a
jump (``wait`` otherwise). With a 2x slower rank, a jump at step 5 spares 5 steps at balance
0.5 (0.02 of a 150-step run's balance); on this 2-core machine the first 4 steps are often
too noisy for it (code-lm: ±7 % on one rank in ``poise bench balance``'s run c), and the
equal split is kept until step 10, as before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.balance.costs import AttentionCost, fit_alpha
from poise.balance.sampler import BalancedBatchSampler
from poise.balance.speeds import (
    choose_shares,
    estimate_speeds,
    move_confirmed,
    speed_scatter,
    step_costs,
)

log = logging.getLogger(__name__)

PRECISER = 0.8  # each rank's own α is used when it cuts the worst per-step speed scatter by 20 %
HISTORY_STEPS = 100  # the most steps α is fitted from (the seed's longest window)


@dataclass(frozen=True)
class Replan:
    """One re-plan, for logs and the report."""

    step: int
    speeds: list[float]  # cost units per second, per rank
    shares: list[float]
    alpha: float | None
    rel_error: list[float] | None = None  # relative standard error of each speed
    # hold, jump, edge or damped (choose_shares); wait: in the cold start, not confident; confirm
    # or revert: a move's measured steps judged (confirm_steps); trial: waiting for them
    decision: str = "damped"
    window_steps: int = 0  # steps the estimate used (fewer after a change of speed)
    rank_alphas: list[float] | None = None  # each rank's own α (its speed is in its own cost units)
    measured_balance: list[float] | None = None  # confirm, revert: the balance before and after the move


class DynamicPartitioner:
    """Feeds measured speeds back into a :class:`BalancedBatchSampler` (see module doc)."""

    def __init__(
        self,
        sampler: BalancedBatchSampler,
        *,
        cold_start_steps: int = 10,
        window_steps: int = 20,
        replan_every_steps: int = 5,
        max_share_change: float = 0.15,
        confident_error: float = 0.05,
        fit_alpha: bool = True,
        device: torch.device | None = None,
        confirm_steps: int = 0,
        group: dist.ProcessGroup | None = None,
        max_replan_every_steps: int | None = None,
    ) -> None:
        self.sampler = sampler
        # None: a re-plan every replan_every_steps; else the interval doubles after each hold up to
        # this, and any other decision brings it back (see :meth:`after_step`)
        self.max_replan_every_steps = max_replan_every_steps
        self._every = replan_every_steps
        self._next_due = 0  # (stretched cadence) the recorded step count of the next re-plan
        self.confirm_steps = confirm_steps  # 0: moves are not checked against their measured steps
        self._trial: tuple[int, np.ndarray] | None = None  # (observed count at a move, the shares before it)
        self._quiet_until = 0  # after a revert, no move before this many observed steps
        self.cold_start_steps = cold_start_steps
        self.replan_every_steps = replan_every_steps
        self.max_share_change = max_share_change
        self.confident_error = confident_error
        self._observed = 0  # steps seen by this process (the first is left out)
        self.fit_alpha = fit_alpha and isinstance(sampler.cost_fn, AttentionCost) and sampler.cost_fn.alpha > 0
        self.device = device or torch.device("cpu")
        # the group the windows are gathered in (None: the default one); an NCCL job passes a gloo
        # group of the same ranks, so that a re-plan after every step never waits on the GPU stream
        self.group = group
        self.shares = np.full(sampler.world_size, 1.0 / sampler.world_size)
        self.window_steps = window_steps
        # the steps since the last change of speed (at most HISTORY_STEPS): α is fitted from
        # all of them, speeds from the last ``window_steps``
        self.window: deque[tuple[float, float, float]] = deque(maxlen=max(window_steps, HISTORY_STEPS))
        self.history: list[Replan] = []
        # seconds in re-plans, the all-gather included (its wait for the last rank to end its step
        # is time the next step's all-reduce would wait otherwise), and of them in deciding alone
        self.spent_s = 0.0
        self.decide_s = 0.0

    def observe(self, batch_lengths: np.ndarray, compute_s: float) -> None:
        """Record this rank's step: its batch's lengths and its own compute seconds."""
        self._observed += 1
        if self._observed == 1:
            return  # DDP's bucket rebuild and lazy allocations: not this rank's speed
        self.window.append((*self.sampler.cost_terms(batch_lengths), compute_s))

    def due(self, steps_done: int) -> bool:
        """Whether to re-plan before the next step, after ``steps_done`` steps in total: at the
        cold start's end and every ``replan_every_steps`` steps after it; before that, at
        multiples of ``replan_every_steps`` too, where only a confident estimate acts (see
        :meth:`replan`)."""
        if self.max_replan_every_steps is not None:
            return steps_done >= self._next_due
        since = steps_done - self.cold_start_steps
        every = self.replan_every_steps
        # by step counts only, the same on every rank (a rank's window may be empty: a resume
        # from another rank's state; the gather then uses what every rank has)
        return steps_done % every == 0 if since < 0 else since % every == 0

    def after_step(self, recorded: int, steps_done: int, last_step: int | None = None) -> None:
        """A step ended: ``recorded`` of the ``steps_done`` steps have their figures observed
        (on CUDA one lags); re-plan when :meth:`due` and steps remain before ``last_step`` (the
        run's last, if known). A collective when it re-plans: every rank reaches it alike.

        With ``max_replan_every_steps``, the steps to the next re-plan double after each
        ``hold`` (up to that many) and go back to ``replan_every_steps`` after any other
        decision: shares that hold cost a gather and a decision every few steps, not every
        step, while a move, its trial and the cold start are followed step by step. Every rank
        decides the same from the same gathered numbers, so every rank keeps the same cadence."""
        if self.due(recorded) and (last_step is None or steps_done < last_step):
            event = self.replan(steps_done)
            if self.max_replan_every_steps is not None:
                held = event.decision == "hold"
                self._every = min(2 * self._every, self.max_replan_every_steps) if held else self.replan_every_steps
                self._next_due = recorded + self._every

    def replan(self, step: int) -> Replan:
        """Exchange windows (a collective: call on every rank at the same step) and re-split."""
        started = time.perf_counter()
        try:
            return self._replan(step)
        finally:
            self.spent_s += time.perf_counter() - started

    def _replan(self, step: int) -> Replan:
        # a fixed-size block on every rank: its step count, then its window (windows may differ in
        # length after a resume from another rank's state, where only the shares are shared)
        capacity = self.window.maxlen or HISTORY_STEPS
        block = np.zeros((capacity + 1, 3))
        block[0, 0] = len(self.window)
        if self.window:
            block[1:1 + len(self.window)] = np.asarray(self.window, dtype=np.float64)
        mine = torch.tensor(block, dtype=torch.float64, device=self.device)
        world = self.sampler.world_size
        if world > 1:
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine, group=self.group)
            blocks = torch.stack(parts).cpu().numpy()  # [ranks, 1 + capacity, 3]
        else:
            blocks = mine.cpu().numpy()[None]
        counts = blocks[:, 0, 0].astype(np.int64)
        common = int(counts.min())  # the newest steps every rank has
        if common == 0:  # nothing measured on some rank yet: nothing to decide (not recorded)
            return Replan(step, [], self.shares.tolist(), getattr(self.sampler.cost_fn, "alpha", None),
                          decision="wait")
        every = np.stack([blocks[r, 1 + counts[r] - common:1 + counts[r]] for r in range(world)])  # [ranks, steps, 3]
        started = time.perf_counter()
        try:
            return self.decide(every, step)
        finally:
            self.decide_s += time.perf_counter() - started

    def decide(self, every: np.ndarray, step: int) -> Replan:
        """The re-plan from every rank's gathered window (``[ranks, steps, 3]``: the terms of
        :func:`~poise.balance.speeds.window_terms`), with no communication: what :meth:`replan` does once it has
        them, and what a test drives with recorded measurements. Sets the sampler's speeds."""
        world = self.sampler.world_size
        judged = self._judge(every, step)
        if judged is not None:
            return judged
        recent = every[:, -self.window_steps:]
        alpha = getattr(self.sampler.cost_fn, "alpha", None)
        own = self.sampler.rank_cost_fns
        adopted = own is not None and all(isinstance(f, AttentionCost) for f in own)
        before_alphas = np.array([f.alpha for f in own]) if adopted else np.full(world, alpha or 0.0)
        alphas = before_alphas
        # A change of speed, judged in the current units: the older steps describe a device
        # that is gone, for α too.
        keep = estimate_speeds(step_costs(recent, alphas), recent[:, :, 2]).keep_steps
        changed = keep < recent.shape[1]  # a change of speed
        if changed:
            every = recent = recent[:, -keep:]
            self._forget_before(keep)
        if self.fit_alpha:
            fits = [fit_alpha(every[r, :, 0], every[r, :, 1], every[r, :, 2]) for r in range(world)]
            known = [a for a in fits if a is not None]
            if known:
                alpha = float(np.median(known))
                self.sampler.set_cost_fn(AttentionCost(alpha))
                fitted = np.array([alpha if a is None else a for a in fits])  # a failed fit: the median
                alphas = np.full(world, alpha)
                # Each rank's own α is taken only from at least a full window of steps, and
                # only when it makes the per-step speeds clearly steadier (they vary less once
                # the cost is right): fitted from 9 steps, a half-speed rank's α came out 1/15
                # of its peer's.
                if every.shape[1] >= self.window_steps and \
                        speed_scatter(every, fitted) < PRECISER * speed_scatter(every, alphas):
                    alphas = fitted
                self.sampler.set_rank_cost_fns(
                    [AttentionCost(float(a)) for a in alphas] if np.any(alphas != alpha) else None)
        before = self.shares
        new_units = (np.ptp(alphas) > 0 or np.ptp(before_alphas) > 0) and not np.array_equal(alphas, before_alphas)
        if new_units:
            # Shares are in each rank's own cost units: put the current ones in the new units.
            lin, quad = recent[:, :, 0].sum(axis=1), recent[:, :, 1].sum(axis=1)
            before = before * (lin + alphas * quad) / (lin + before_alphas * quad)
        estimate = estimate_speeds(step_costs(recent, alphas), recent[:, :, 2])
        shares, decision = choose_shares(before, estimate, self.max_share_change, self.confident_error)
        if new_units and decision == "hold":
            # The converted shares are right only for the window's mix of lengths, not for each
            # step: held, they kept rank 1 5 % over its time for 33 steps (run c of
            # runs/s38-rep3, c-dynamic-slow-1). Within the noise, the estimate in the new units
            # is as good as any: take it.
            shares, decision = estimate.speeds / estimate.speeds.sum(), "jump"
        if self._observed < self.cold_start_steps and decision != "jump":
            shares, decision = self.shares, "wait"  # the cold start: only a confident estimate acts
        if decision in ("jump", "edge", "damped") and self.confirm_steps:
            if self._observed < self._quiet_until and not changed:
                shares, decision = self.shares, "hold"  # a move was just undone and the speeds have not changed
            else:
                self._trial = (self._observed, self.shares.copy())
        self.shares = shares
        if estimate.keep_steps < recent.shape[1]:  # seen only in the new units
            self._forget_before(estimate.keep_steps)
        self.sampler.set_speeds(self.shares)
        event = Replan(step, estimate.speeds.tolist(), self.shares.tolist(), alpha,
                       [float(e) for e in estimate.rel_error], decision, estimate.keep_steps,
                       alphas.tolist() if self.fit_alpha else None)
        self.history.append(event)
        log.info(
            "re-plan at step %d (%s, %d steps): speeds %s cost/s (±%s), shares %s, alpha %s",
            step, decision, estimate.keep_steps, [f"{s:,.0f}" for s in estimate.speeds],
            [f"{e:.1%}" for e in estimate.rel_error], [f"{s:.3f}" for s in self.shares],
            "-" if alpha is None else " ".join(f"{a:.2e}" for a in alphas),
        )
        return event

    def _judge(self, every: np.ndarray, step: int) -> Replan | None:
        """During a move's trial: hold until its ``confirm_steps`` steps are measured, then keep
        it (``confirm``) or undo it (``revert``); None when no trial is running."""
        if self._trial is None:
            return None
        moved_at, before = self._trial
        since = self._observed - moved_at
        if since < self.confirm_steps:
            return self._record(step, "trial", None)
        self._trial = None
        if every.shape[1] <= self.confirm_steps:  # a change of speed dropped the steps before the move
            return None
        kept, old, new = move_confirmed(every[:, :, 2], self.confirm_steps)
        if kept:
            return self._record(step, "confirm", (old, new))
        self.shares = before
        self.sampler.set_speeds(self.shares)
        self._quiet_until = self._observed + self.window_steps
        log.warning("re-plan at step %d: the last move is undone: balance %.3f in the %d steps after it against %.3f "
                    "before", step, new, self.confirm_steps, old)
        return self._record(step, "revert", (old, new))

    def _record(self, step: int, decision: str, balances: tuple[float, float] | None) -> Replan:
        """A re-plan that only judged (or waited for) the last move; the shares as they now stand."""
        last = self.history[-1] if self.history else None
        event = Replan(step, last.speeds if last else [], self.shares.tolist(), last.alpha if last else None,
                       last.rel_error if last else None, decision, self.confirm_steps,
                       last.rank_alphas if last else None,
                       measured_balance=None if balances is None else [round(b, 4) for b in balances])
        if decision != "trial":
            self.history.append(event)
        return event

    def _forget_before(self, keep: int) -> None:
        """Keep only the newest ``keep`` steps (a change of speed: the older ones are stale)."""
        while len(self.window) > keep:
            self.window.popleft()

    def state_dict(self) -> dict[str, Any]:
        # a move being judged and the quiet after an undone one, in steps from now (a resumed
        # process counts its own steps from 0)
        trial = None if self._trial is None else [self._observed - self._trial[0], self._trial[1].tolist()]
        return {"shares": self.shares.tolist(), "window": list(self.window),
                "history": [e.__dict__ for e in self.history], "trial": trial,
                "quiet_steps": max(0, self._quiet_until - self._observed),
                # the stretched cadence, in the run's recorded steps (saved and restored with them)
                "replan_every": self._every, "next_replan": self._next_due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``window`` is this rank's own (empty when the state is
        another rank's: the gather then decides from the steps every rank has measured)."""
        self.shares = np.asarray(state["shares"], dtype=np.float64)
        trial = state.get("trial")  # a move being judged, and the quiet after an undone one (older states: none)
        self._trial = None if trial is None else (self._observed - int(trial[0]),
                                                  np.asarray(trial[1], dtype=np.float64))
        self._quiet_until = self._observed + int(state.get("quiet_steps", 0))
        self._every = int(state.get("replan_every", self.replan_every_steps))
        self._next_due = int(state.get("next_replan", 0))
        self.window.clear()
        self.window.extend(tuple(w) for w in state["window"])
        self.history = [Replan(**e) for e in state["history"]]
