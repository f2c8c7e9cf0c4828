"""Re-measuring rank speeds while training and re-planning the split (the seed's DynamicPartitioner).

Every rank records, per step, the padded cost terms of its own batch (n·Lmax and n·Lmax²)
and its own compute seconds (from the timeline's probe, so waiting for others is excluded).
At re-plan steps the ranks exchange their records since the last change of speed (at most
``HISTORY_STEPS``) with one small all-gather, and every rank then computes the same thing
from the same numbers:

1. α of the cost L + α·L² refitted (when ``fit_alpha``) for every rank from all those steps,
   in relative error (:func:`~poise.balance.costs.fit_alpha`); the median over ranks groups
   and budgets the steps and splits them, unless each rank's own α makes the per-step speeds
   steadier by ``1 - PRECISER`` (:func:`speed_scatter`): then each rank's own α splits them
   (a rank throttled by a CPU quota measured up to 4x the α of its unthrottled peer: it
   loses more on long samples). α is a property of the device and the model, and a 20-step
   window of code-lm holds few steps of short samples, so its fits swung by 10x from one
   re-plan to the next;
2. a change of speed: when the last ``RECENT_STEPS`` steps of some rank differ from the rest of
   the last ``window_steps`` by more than ``CHANGE_Z`` standard errors (and by more than
   10 %), relative to the other ranks in the same steps, the older steps describe a device
   that is gone, and every rank drops them, keeping the steps since the most likely step of
   the change (:func:`estimate_speeds`, :func:`change_point`);
3. each rank's speed over the last ``window_steps`` steps (in its own cost units): the
   geometric mean of the per-step speeds (:func:`~poise.balance.costs.measured_speeds`), and
   its relative standard error from the spread of its per-step speed relative to the other
   ranks' in the same step (what the whole machine or a step's lengths do to every rank
   cancels: it does not move the shares);
4. the new shares (:func:`choose_shares`): none when the move would be within the
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
of the ranks' compute seconds, :func:`move_confirmed`) is compared with that of as many steps
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
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from poise.balance.costs import AttentionCost, fit_alpha, measured_speeds
from poise.balance.sampler import BalancedBatchSampler

log = logging.getLogger(__name__)

RECENT_STEPS = 5  # the steps compared with the rest of the window to notice a change of speed
# ... of which at least this many newest ones must differ (two steps that happen to agree read
# as a change too often on a loaded machine)
MIN_CHANGE_STEPS = 3
CHANGE_Z = 4.0  # standard errors between them that count as a change (not noise)
MIN_CHANGE = 0.10  # ... and the smallest relative change of speed that does
PRECISER = 0.8  # each rank's own α is used when it cuts the worst per-step speed scatter by 20 %
HISTORY_STEPS = 100  # the most steps α is fitted from (the seed's longest window)
# a move is undone when the measured balance after it is this much below the balance before it
# (a median of 3 steps' balance scattered by about 0.03 on a quiet 2-core machine)
CONFIRM_MARGIN = 0.05


def step_balance(seconds: np.ndarray) -> np.ndarray:
    """Each step's measured balance from ``[ranks, steps]`` compute seconds: the mean over ranks
    over the slowest rank's (1.0: nobody waited). A step where nobody computed reads 1."""
    seconds = np.asarray(seconds, dtype=np.float64)
    slowest = seconds.max(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(slowest > 0, seconds.mean(axis=0) / slowest, 1.0)


def move_confirmed(seconds: np.ndarray, after_steps: int, margin: float = CONFIRM_MARGIN) -> tuple[bool, float, float]:
    """Whether the last ``after_steps`` steps of ``seconds`` (``[ranks, steps]``, the steps
    since a move) are balanced no worse than the (up to) ``after_steps`` before them, less
    ``margin``; with the two medians of :func:`step_balance` (before, after). Pure."""
    balances = step_balance(seconds)
    after = float(np.median(balances[-after_steps:]))
    before_part = balances[-2 * after_steps:-after_steps]
    before = float(np.median(before_part)) if len(before_part) else after
    return after >= before - margin, before, after


@dataclass(frozen=True)
class SpeedEstimate:
    """Speeds measured over a window, with their uncertainty.

    Attributes:
        speeds: cost units per second of own compute, per rank.
        rel_error: relative standard error of each rank's speed (inf with fewer than 2 steps).
        keep_steps: how many of the newest steps of the window the estimate used (all of them,
            or the last ``RECENT_STEPS`` when some rank's speed changed).
    """

    speeds: np.ndarray
    rel_error: np.ndarray
    keep_steps: int


def estimate_speeds(cost: np.ndarray, seconds: np.ndarray) -> SpeedEstimate:
    """Every rank's speed over a window of steps, after dropping steps from before a change.

    Args:
        cost: ``[ranks, steps]`` cost units each rank processed per step.
        seconds: ``[ranks, steps]`` each rank's own compute seconds per step.

    Only the ranks' speeds *relative to each other* decide the shares, so the change test and
    the errors are taken on each step's log speed minus the mean of the other ranks' in that
    step (a lone rank: 0). What all
    ranks share in a step cancels there: the machine slowing down for everyone, and a cost
    model that is off for the step's lengths (every rank's batch has about the same lengths).
    On ``poise bench balance``'s equal ranks (b) the two ranks' per-step deviations from their
    cost models correlated by 0.7-0.9, so the relative speeds scatter much less than either
    rank's own; and a change of speed is a change of one rank against the others, not a run
    of long-sample steps under an α that fits them badly (which had read as a doubling of
    both ranks' speeds and dropped the history: run c, ``runs/s39-bce3``, step 65).

    Pure: every rank computes the same estimate from the same gathered numbers. O(ranks·steps).

    Raises:
        ValueError: if a rank has no measured time.
    """
    cost, seconds = np.asarray(cost, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    steps = cost.shape[1]
    keep = steps
    with np.errstate(divide="ignore", invalid="ignore"):
        log_speed = np.log(cost / np.where(seconds > 0, seconds, np.nan))
    log_speed[~np.isfinite(log_speed)] = np.nan
    # against the mean of the *other* ranks in the same step: the error of a speed ratio
    known = np.isfinite(log_speed)
    total, count = np.where(known, log_speed, 0.0).sum(axis=0), known.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        others = np.where(count > 1, (total - log_speed) / (count - 1), log_speed)
    relative = log_speed - others
    # a rank that computed nothing in the recent steps (a deadline moved all its work to the
    # others) has no speed there: the window is not narrowed to them
    if steps >= 3 * RECENT_STEPS and np.all(known[:, -RECENT_STEPS:].any(axis=1)):
        since, z = change_point(relative)
        if z > CHANGE_Z:
            keep = since
    speeds = measured_speeds(cost[:, -keep:], seconds[:, -keep:])
    if keep >= 2:  # the standard error of the mean relative log speed: a relative error
        rel_error = np.nanstd(relative[:, -keep:], axis=1, ddof=1) / np.sqrt(keep)
    else:
        rel_error = np.full(len(speeds), np.inf)
    return SpeedEstimate(speeds, rel_error, keep)


def change_point(relative: np.ndarray) -> tuple[int, float]:
    """Where a change of speed in the last ``RECENT_STEPS`` steps most likely happened: the
    ``k`` in ``MIN_CHANGE_STEPS``..``RECENT_STEPS`` whose split of ``relative`` (``[ranks, steps]``, each step's
    log speed relative to the other ranks) into older and newer steps differs most, in
    standard errors, for a rank whose speed moved by more than ``MIN_CHANGE``; with that
    number of standard errors (0 when no rank moved that much). Why every ``k``: re-planned
    after every step, a change is seen three steps after it, and the last
    ``RECENT_STEPS`` steps then mix steps from before it into the new speeds (seen later,
    and with a window that kept those steps, the split took as many steps again to settle).
    Pure."""
    best_k, best_z = RECENT_STEPS, 0.0
    with warnings.catch_warnings():  # a rank with no speed in a part: NaN there, never the best
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(MIN_CHANGE_STEPS, RECENT_STEPS + 1):
            old, new = relative[:, :-k], relative[:, -k:]
            shift = np.nanmean(new, axis=1) - np.nanmean(old, axis=1)
            se = np.sqrt(np.nanvar(old, axis=1, ddof=1) / old.shape[1] + np.nanvar(new, axis=1, ddof=1) / k)
            z = np.where(np.abs(np.expm1(shift)) > MIN_CHANGE, np.abs(shift) / np.maximum(se, 1e-12), 0.0)
            if np.nanmax(z) > best_z:
                best_k, best_z = k, float(np.nanmax(z))
    return best_k, best_z


def choose_shares(current: np.ndarray, estimate: SpeedEstimate, max_change: float,
                  confident_error: float) -> tuple[np.ndarray, str]:
    """The next shares from ``current`` and a speed estimate, and how they were chosen:
    ``hold`` (the move is within two standard errors: noise), ``jump`` (every estimate is
    confident: straight to the shares proportional to speed), ``edge`` (to the near edge of
    the two-standard-error band around the target) or ``damped`` (at most ``max_change``
    relative per share), whichever of the last two lands closer to the target.

    Why the edge: an estimate known to 8 % that asks for a 35 % move is sure of the first
    19 % of it (35 % less two errors), and the damping alone took three re-plans to get there
    (run c of ``poise bench balance``, where the first re-plan after the cold start reads about
    that). The edge stays on the near side of the band, so it cannot overshoot the true
    speeds unless they lie outside it (2.3 % of estimates, for normal errors), and it moves
    less as the error grows: the move is bounded by what the measurement shows. See the
    module doc."""
    current = np.asarray(current, dtype=np.float64) / np.sum(current)
    target = estimate.speeds / estimate.speeds.sum()
    worst = float(np.max(estimate.rel_error))
    if float(np.max(np.abs(target / current - 1.0))) <= 2.0 * worst:
        return current, "hold"
    if worst <= confident_error:
        return target, "jump"
    damped = next_shares(current, estimate.speeds, max_change)
    edge = next_shares(target, current, 2.0 * worst)  # current, brought inside the band

    def miss(shares: np.ndarray) -> float:
        return float(np.max(np.abs(shares / target - 1.0)))

    return (edge, "edge") if miss(edge) < miss(damped) else (damped, "damped")


def next_shares(current: np.ndarray, speeds: np.ndarray, max_change: float) -> np.ndarray:
    """Shares proportional to ``speeds``, each within ±``max_change`` (relative) of ``current``.

    Returns shares that sum to 1. Clipping and renormalising alternate until both hold (a
    few rounds; renormalising can only push a clipped share back inside its bounds).
    """
    current = np.asarray(current, dtype=np.float64) / np.sum(current)
    target = np.asarray(speeds, dtype=np.float64) / np.sum(speeds)
    low, high = current * (1 - max_change), current * (1 + max_change)
    shares = np.clip(target, low, high)
    for _ in range(50):
        shares = shares / shares.sum()
        clipped = np.clip(shares, low, high)
        if np.allclose(clipped, shares, rtol=0, atol=1e-12):
            break
        shares = clipped
    return shares / shares.sum()


def step_costs(steps: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """``[ranks, steps]`` cost units of each rank's batches, from the recorded terms ``steps``
    (``[ranks, steps, 3]``, as :func:`window_terms`) with each rank's α."""
    return steps[:, :, 0] + np.asarray(alphas, dtype=np.float64)[:, None] * steps[:, :, 1]


def speed_scatter(steps: np.ndarray, alphas: np.ndarray) -> float:
    """The worst rank's standard deviation of log(cost / seconds) over ``steps``
    (``[ranks, steps, 3]``: n·Lmax, n·Lmax², compute seconds, as :func:`window_terms`), each
    rank's cost with its entry of ``alphas``: how far one step's speed strays from the
    rank's typical one, which is what a step's balance loses to the cost model. A relative
    number (0.05: 5 %)."""
    cost, seconds = step_costs(steps, alphas), steps[:, :, 2]
    log_speed = np.log(np.where(seconds > 0, cost, np.nan) / np.where(seconds > 0, seconds, np.nan))
    return float(np.max(np.nanstd(log_speed, axis=1)))


def window_terms(batch_lengths: np.ndarray, compute_s: float) -> tuple[float, float, float]:
    """What the re-planner records of one step: the padded cost terms of the rank's batch
    (``n·Lmax``, ``n·Lmax²``, from which any α gives the cost) and its own compute seconds."""
    n, longest = len(batch_lengths), float(np.max(batch_lengths)) if len(batch_lengths) else 0.0
    return (n * longest, n * longest * longest, compute_s)


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
    ) -> None:
        self.sampler = sampler
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
        self.window.append(window_terms(batch_lengths, compute_s))

    def due(self, steps_done: int) -> bool:
        """Whether to re-plan before the next step, after ``steps_done`` steps in total: at the
        cold start's end and every ``replan_every_steps`` steps after it; before that, at
        multiples of ``replan_every_steps`` too, where only a confident estimate acts (see
        :meth:`replan`)."""
        since = steps_done - self.cold_start_steps
        every = self.replan_every_steps
        # by step counts only, the same on every rank (a rank's window may be empty: a resume
        # from another rank's state; the gather then uses what every rank has)
        return steps_done % every == 0 if since < 0 else since % every == 0

    def after_step(self, recorded: int, steps_done: int, last_step: int | None = None) -> None:
        """A step ended: ``recorded`` of the ``steps_done`` steps have their figures observed
        (on CUDA one lags); re-plan when :meth:`due` and steps remain before ``last_step`` (the
        run's last, if known). A collective when it re-plans: every rank reaches it alike."""
        if self.due(recorded) and (last_step is None or steps_done < last_step):
            self.replan(steps_done)

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
        :func:`window_terms`), with no communication: what :meth:`replan` does once it has
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
                "quiet_steps": max(0, self._quiet_until - self._observed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``window`` is this rank's own (empty when the state is
        another rank's: the gather then decides from the steps every rank has measured)."""
        self.shares = np.asarray(state["shares"], dtype=np.float64)
        trial = state.get("trial")  # a move being judged, and the quiet after an undone one (older states: none)
        self._trial = None if trial is None else (self._observed - int(trial[0]),
                                                  np.asarray(trial[1], dtype=np.float64))
        self._quiet_until = self._observed + int(state.get("quiet_steps", 0))
        self.window.clear()
        self.window.extend(tuple(w) for w in state["window"])
        self.history = [Replan(**e) for e in state["history"]]
