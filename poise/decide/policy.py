"""The no-settings split (balance ``auto``): what it keeps from plain DDP and how fast it acts.

``auto`` trains plain DDP's steps (:class:`~poise.balance.sampler.MixedBatchSampler`: the
same samples per step as ``DistributedSampler``), so nothing about what is trained changes;
it only decides who computes which of a step's samples, from every rank's measured speed.
Length bucketing, which changes each step's samples (and cost up to 1.4x DDP's tokens to the
same eval loss on code-lm, see docs/decide.md), is never switched on without the user asking
(``balance="cost"`` or ``"dynamic"``).

Why re-plan after every step while the shares move: a re-plan is one all-gather of at most
100 × 3 numbers per rank and a few fits over them, and it moves only when the measured speeds
say so beyond two standard errors (``hold`` otherwise), straight to the target once every
speed is known to ``confident_error`` (:func:`~poise.balance.rebalance.choose_shares`). So a
half-speed rank is balanced as soon as a few steps measure it. Once the shares hold, the
interval doubles after each hold, up to ``AUTO_MAX_REPLAN_EVERY_STEPS``: measured in ``poise
bench auto`` on 2 workers of a 2-core machine, a re-plan after every one of 0.1 s steps took
about 5 % of the training time (3 % deciding, the rest the gather), which a run with nothing to
fix pays for nothing. A change of speed is then seen at most 3 steps later than at every step,
and any decision but a hold brings the cadence back to every step.

Do no harm: a move of the shares is a prediction (the steps will be better balanced), so
``auto`` checks it. For ``AUTO_CONFIRM_STEPS`` steps after a move the shares stay put; if
those steps are measured worse balanced than as many before the move (by more than
:data:`~poise.balance.rebalance.CONFIRM_MARGIN`), the move is undone and said so (decision
``revert``), and the split stays until the speeds change.

The gradient codec (:func:`default_codec`): a codec can pay only where the all-reduce crosses
a network link, so with no codec named a job on one node sends exact gradients without any
trial, and a job across nodes runs ``auto`` (``poise/comm/trial.py``): PowerSGD dry runs
after its first exact steps, the codec kept only where its predicted step is ``margin`` times
faster, then dropped again if its measured steps are not.
"""

from __future__ import annotations

from poise.config import BalanceConfig

# steps between re-plans under balance auto, and steps a move is measured before it is kept (see module doc)
AUTO_REPLAN_EVERY_STEPS = 1
AUTO_CONFIRM_STEPS = 3
# ... and the most steps between re-plans once the shares hold (the interval doubles after each hold)
AUTO_MAX_REPLAN_EVERY_STEPS = 4


def default_codec(*, spans_nodes: bool, sharded: bool, sync_mode: str, deadline: bool, accum_steps: int,
                  run_length_known: bool) -> tuple[str, str]:
    """``(codec, why)`` for a run that names no codec (``comm.codec`` unset): ``auto`` across
    nodes where its trial can run, else ``none`` (exact); ``why`` is one sentence for the report.

    Args:
        spans_nodes: the ranks are on more than one node (``poise.comm.topology.spans_nodes``).
        sharded: the model is sharded with ``fully_shard`` (no DDP buckets to dry-run).
        sync_mode: ``sync.mode``; outer steps send no per-step gradient.
        deadline: deadline steps (or emulated delays) time their own micro-batches.
        accum_steps: micro-batches per optimizer step; the trial times whole steps.
        run_length_known: the optimizer steps of the run are known, which a lossy codec's
            uncompressed warm-up (a twentieth of the run) needs.
    """
    if not spans_nodes:
        return "none", "one node: the gradient all-reduce crosses no network link, where a codec could pay"
    if sharded:
        return "none", "a sharded model reduce-scatters its gradients: the codec trial dry-runs DDP's buckets"
    if sync_mode != "step":
        return "none", f"sync={sync_mode!r} sends no gradient all-reduce at every step"
    if deadline or accum_steps != 1:
        return "none", ("the codec trial times whole steps, which deadline steps and gradient accumulation "
                        "split (straggler='off' and accum_steps=1 let poise try PowerSGD)")
    if not run_length_known:
        return "none", ("a lossy codec starts after a twentieth of the run, whose length is not known "
                        "(Data(total_steps=...) lets poise try PowerSGD)")
    return "auto", ("several nodes: PowerSGD is dry-run after the first exact steps and kept only if it pays, "
                    "then dropped if its measured steps do not")


def replan_schedule(balance: BalanceConfig) -> dict[str, int]:
    """The re-planner's cadence for ``balance``'s strategy: ``cold_start_steps`` (steps in which
    only a confident estimate moves the shares), ``replan_every_steps`` and ``confirm_steps``
    (steps a move is measured before it is kept; 0: never undone). ``dynamic`` keeps what its
    config says (a user's pinned settings are never overridden); ``auto`` re-plans after every
    step while it moves, every 2 then 4 steps while the shares hold, and confirms its moves
    (see module doc); ``max_replan_every_steps``: None for a fixed cadence."""
    auto = balance.strategy == "auto"
    return {"cold_start_steps": balance.cold_start_steps,
            "replan_every_steps": AUTO_REPLAN_EVERY_STEPS if auto else balance.replan_every_steps,
            "confirm_steps": AUTO_CONFIRM_STEPS if auto else 0,
            "max_replan_every_steps": AUTO_MAX_REPLAN_EVERY_STEPS if auto else None}


__all__ = ["AUTO_CONFIRM_STEPS", "AUTO_MAX_REPLAN_EVERY_STEPS", "AUTO_REPLAN_EVERY_STEPS", "default_codec",
           "replan_schedule"]
