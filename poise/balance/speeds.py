"""Speeds from measured steps, and the shares they ask for: the re-planner's pure part.

Every rank computes the same thing from the same gathered numbers, with no communication:
each rank's speed and its error relative to the other ranks (:func:`estimate_speeds`), where a
change of speed happened (:func:`change_point`), the next shares (:func:`choose_shares`), and
whether a move did what it predicted (:func:`move_confirmed`). How they are used, and why, is
:mod:`poise.balance.rebalance`'s module doc; the numbers are the terms of
:func:`window_terms`, recorded per rank and step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from poise.balance.costs import measured_speeds

RECENT_STEPS = 5  # the steps compared with the rest of the window to notice a change of speed
# ... of which at least this many newest ones must differ (two steps that happen to agree read
# as a change too often on a loaded machine)
MIN_CHANGE_STEPS = 3
CHANGE_Z = 4.0  # standard errors between them that count as a change (not noise)
MIN_CHANGE = 0.10  # ... and the smallest relative change of speed that does
# a move is undone when the measured balance after it is this much below the balance before it
# (a median of 3 steps' balance scattered by about 0.03 on a quiet 2-core machine)
CONFIRM_MARGIN = 0.05
# Student's t at 97.5 % for 1, 2, ... degrees of freedom, over the normal's 1.96: a standard
# error estimated from k steps is widened by T_WIDEN[k - 2] (1 past the table), so that "two
# standard errors" means the same confidence after 2 steps as after 30. Unwidened, 2 steps whose
# speeds happened to agree read as known to 5 % (1 degree of freedom: the spread of 2 numbers):
# over 2 emulated nodes, the first 2 measured steps of equal ranks asked for shares 0.618 0.382
# and got them, and the split took 14 steps to come back (poise bench auto, S4).
T_WIDEN = tuple(t / 1.96 for t in (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
                                   2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
                                   2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042))


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
        rel_error: relative standard error of each rank's speed, widened for few steps by
            :data:`T_WIDEN` (inf with fewer than 2 steps).
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
    if keep >= 2:  # the standard error of the mean relative log speed (a relative error), widened for few steps
        widen = T_WIDEN[keep - 2] if keep - 2 < len(T_WIDEN) else 1.0
        rel_error = widen * np.nanstd(relative[:, -keep:], axis=1, ddof=1) / np.sqrt(keep)
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


__all__ = ["CHANGE_Z", "CONFIRM_MARGIN", "MIN_CHANGE", "MIN_CHANGE_STEPS", "RECENT_STEPS", "T_WIDEN", "SpeedEstimate",
           "change_point", "choose_shares", "estimate_speeds", "move_confirmed", "next_shares", "speed_scatter",
           "step_balance", "step_costs", "window_terms"]
