"""The no-settings split (balance ``auto``): what it keeps from plain DDP and how fast it acts.

``auto`` trains plain DDP's steps (:class:`~poise.balance.sampler.MixedBatchSampler`: the
same samples per step as ``DistributedSampler``), so nothing about what is trained changes;
it only decides who computes which of a step's samples, from every rank's measured speed.
Length bucketing, which changes each step's samples (and cost up to 1.4x DDP's tokens to the
same eval loss on code-lm, see docs/decide.md), is never switched on without the user asking
(``balance="cost"`` or ``"dynamic"``).

Why re-plan after every step: a re-plan is one all-gather of at most 100 × 3 numbers per rank
and a few fits over them (about a millisecond here, against steps of tenths of seconds), and
it moves only when the measured speeds say so beyond two standard errors (``hold``
otherwise), straight to the target once every speed is known to ``confident_error``
(:func:`~poise.balance.rebalance.choose_shares`). So acting every step costs nothing, a
half-speed rank is balanced as soon as a few steps measure it, and a change of speed is
followed as soon as the change test sees it (``RECENT_STEPS`` steps), not at the next
multiple of ``replan_every_steps``.

Do no harm: a move of the shares is a prediction (the steps will be better balanced), so
``auto`` checks it. For ``AUTO_CONFIRM_STEPS`` steps after a move the shares stay put; if
those steps are measured worse balanced than as many before the move (by more than
:data:`~poise.balance.rebalance.CONFIRM_MARGIN`), the move is undone and said so (decision
``revert``), and the split stays until the speeds change.
"""

from __future__ import annotations

from poise.config import BalanceConfig

# steps between re-plans under balance auto, and steps a move is measured before it is kept (see module doc)
AUTO_REPLAN_EVERY_STEPS = 1
AUTO_CONFIRM_STEPS = 3


def replan_schedule(balance: BalanceConfig) -> dict[str, int]:
    """The re-planner's cadence for ``balance``'s strategy: ``cold_start_steps`` (steps in which
    only a confident estimate moves the shares), ``replan_every_steps`` and ``confirm_steps``
    (steps a move is measured before it is kept; 0: never undone). ``dynamic`` keeps what its
    config says (a user's pinned settings are never overridden); ``auto`` re-plans after every
    step and confirms its moves (see module doc)."""
    auto = balance.strategy == "auto"
    return {"cold_start_steps": balance.cold_start_steps,
            "replan_every_steps": AUTO_REPLAN_EVERY_STEPS if auto else balance.replan_every_steps,
            "confirm_steps": AUTO_CONFIRM_STEPS if auto else 0}


__all__ = ["AUTO_CONFIRM_STEPS", "AUTO_REPLAN_EVERY_STEPS", "replan_schedule"]
