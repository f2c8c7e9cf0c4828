"""Every choice in force in a run, said plainly: :class:`Decision` and :func:`decisions`.

A choice is worth what its reason is worth, so each one carries the step it took effect,
the figures it was taken on, one sentence of why, and the setting that pins it (a pinned
setting is never overridden). :func:`decisions` builds them from a report's own keys (the
re-planner's ``replans``, the ``codec_trial``, the synchronization's ``sync``), so the same
function serves the run that writes the report, the console summary and ``poise diagnose
run`` reading an old report back. Pure: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# re-plan decisions that move the shares (poise.balance.rebalance.choose_shares); hold and wait do not
MOVES = ("jump", "edge", "damped")
SPLITS = {
    "auto": "plain DDP's steps (the same samples), each split by cost and measured speed into ranges of "
            "similar lengths",
    "static": "DistributedSampler: equal sample counts, plain DDP's split",
    "cost": "length-bucketed steps split by cost (the steps' samples differ from DDP's)",
    "dynamic": "length-bucketed steps split by cost and measured speed (the steps' samples differ from DDP's)",
}


@dataclass(frozen=True)
class Decision:
    """One choice in force from ``step`` on.

    Attributes:
        knob: what was decided (``balance``, ``balance.shares``, ``comm.codec``, ``sync``, ``straggler``).
        choice: what is in force, in words.
        step: the step it took effect (0: from the start).
        why: the reason, one sentence with its figures.
        pin: the setting that pins it (a pinned setting is never overridden).
        by: ``poise`` when poise chose it from measurements or its defaults, ``you`` when the
            run's settings said so (``comm='auto'`` asks poise to measure: its choices are poise's).
        figures: the numbers it was taken on (seconds, cost units per second, shares).
    """

    knob: str
    choice: str
    step: int
    why: str
    pin: str
    by: str = "poise"
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decisions(report: Mapping[str, Any]) -> list[Decision]:
    """The run's decisions, in the order they took effect, from its report's keys
    (``balance_strategy``, ``replans``, ``codec``, ``codec_trial``, ``sync``, ``straggler``).
    Keys a report lacks give no decision."""
    found = [*_balance(report), *_codec(report), *_sync(report), *_straggler(report)]
    return sorted(found, key=lambda d: d.step)


def describe(items: Sequence[Mapping[str, Any] | Decision], *, most: int = 8) -> list[str]:
    """One line per decision for a console: ``step N  knob: choice (by) — why [pin: ...]``.
    Past ``most`` share moves, the middle ones are counted, not listed."""
    rows = [d.as_dict() if isinstance(d, Decision) else dict(d) for d in items]
    moves = [i for i, r in enumerate(rows) if r.get("knob") == "balance.shares"]
    hidden = set(moves[most // 2:len(moves) - most // 2]) if len(moves) > most else set()
    lines: list[str] = []
    for i, r in enumerate(rows):
        if i in hidden:
            if i == min(hidden):
                lines.append(f"  ... {len(hidden)} more share moves (report.json: decisions)")
            continue
        lines.append(f"step {r.get('step', 0):>4}  {r.get('knob')}: {r.get('choice')} ({r.get('by', 'poise')}) — "
                     f"{r.get('why')} [pin: {r.get('pin')}]")
    return lines


def _balance(report: Mapping[str, Any]) -> list[Decision]:
    strategy = report.get("balance_strategy")
    if strategy not in SPLITS:
        return []
    own = report.get("balance_sampler")
    if strategy == "auto" and isinstance(own, Mapping) and not own.get("replanned"):
        # Data(sampler=...) that auto cannot re-plan: the user's sampler decides every step
        first = Decision(
            "balance", f"your {own.get('type')}: its own steps and split, not re-planned", 0,
            f"Data(sampler=...) gave a {own.get('type')}, which poise does not re-plan (only a "
            "BalancedBatchSampler is); give lengths or costs instead of a sampler to let poise split the steps",
            "balance='static' (to say the sampler's split is meant)", by="you")
    elif strategy == "auto":
        first = Decision(
            "balance", f"auto: {SPLITS['auto']}", 0,
            "no balance setting: poise trains DDP's samples and moves work only by measured speed; length "
            "bucketing would change the steps' samples, so it is left to balance='cost' or 'dynamic'",
            "balance='auto' (balance='static' for plain DDP's equal split)", by="poise")
    else:
        first = Decision("balance", f"{strategy}: {SPLITS[strategy]}", 0, f"balance={strategy!r} was set",
                         f"balance={strategy!r}", by="you")
    found = [first]
    for replan in report.get("replans") or []:
        if not isinstance(replan, Mapping) or replan.get("decision") not in (*MOVES, "revert"):
            continue
        shares, speeds = replan.get("shares") or [], replan.get("speeds") or []
        if replan["decision"] == "revert":  # do no harm: a move whose steps measured worse is undone
            before, after = (replan.get("measured_balance") or [float("nan")] * 2)[:2]
            found.append(Decision(
                "balance.shares", "shares " + " ".join(f"{s:.3f}" for s in shares) + " (the last move undone)",
                int(replan.get("step", 0)), f"the {replan.get('window_steps', 0)} steps after the last move measured "
                f"balance {after:.3f} against {before:.3f} before it: it did not pay",
                "balance.replay=<this run's report.json> (the same re-plans at the same steps)",
                figures={"shares": shares, "measured_balance": [before, after]}))
            continue
        errors = replan.get("rel_error") or []
        found.append(Decision(
            "balance.shares", "shares " + " ".join(f"{s:.3f}" for s in shares), int(replan.get("step", 0)),
            f"measured speeds {' '.join(f'{s:,.0f}' for s in speeds)} cost units/s"
            + (f" (±{' ±'.join(f'{e:.1%}' for e in errors)})" if errors else "")
            + f" over {replan.get('window_steps', 0)} steps: {replan['decision']}",
            "balance.replay=<this run's report.json> (the same re-plans at the same steps)",
            figures={"speeds": speeds, "rel_error": errors, "shares": shares}))
    return found


def _codec(report: Mapping[str, Any]) -> list[Decision]:
    codec = report.get("codec")
    if codec is None:
        return []
    decided = report.get("codec_by_poise")  # no codec was named: why poise chose this one
    trial = report.get("codec_trial")
    if codec != "auto" or not isinstance(trial, Mapping):
        if decided:
            return [Decision("comm.codec", "none (exact)" if codec == "none" else str(codec), 0, str(decided),
                             "comm='none' (or comm='auto' to measure PowerSGD here)")]
        return [Decision("comm.codec", str(codec), 0, f"comm={codec!r} was set", f"comm={codec!r}", by="you")]
    plain, coded, uses = trial.get("uncompressed_step_s"), trial.get("codec_step_s"), trial.get("uses_codec")
    start = int(trial.get("start_step") or 0)
    asked = f"{decided} " if decided else ""
    if uses is None:
        return [Decision("comm.codec", "exact (PowerSGD trial not finished)", 0,
                         f"{asked}the run ended before its dry runs at step {start}", "comm='none' or comm='powersgd'")]
    why = (f"a step took {plain:.3f} s uncompressed and {coded:.3f} s predicted with PowerSGD "
           f"(needs {trial.get('margin')}x faster: a lossy step is worth less)" if plain and coded
           else "decided by the dry runs")
    found = [Decision("comm.codec", "powersgd" if uses else "none (exact)", start, asked + why,
                      "comm='powersgd'" if uses else "comm='none'", figures=dict(trial))]
    dropped, measured = trial.get("dropped_step"), trial.get("measured_codec_step_s")
    if uses and dropped is not None and measured is not None and plain:
        found.append(Decision(
            "comm.codec", "none (exact again)", int(dropped),
            f"PowerSGD's steps measured {measured:.3f} s against {plain:.3f} s uncompressed (needs "
            f"{trial.get('margin')}x faster): it did not pay", "comm='none' (or comm='powersgd' to keep it)",
            figures={"measured_codec_step_s": measured, "uncompressed_step_s": plain}))
    return found


def _sync(report: Mapping[str, Any]) -> list[Decision]:
    sync = report.get("sync")
    if not isinstance(sync, Mapping) or "mode" not in sync:
        return []
    choice = sync.get("auto")
    if isinstance(choice, Mapping):
        mode, h = choice.get("mode"), choice.get("inner_steps")
        return [Decision("sync", f"{mode}" + (f", an outer step every {h} steps" if mode != "step" else ""), 0,
                         str(choice.get("why", "")), f"sync=SyncConfig(mode={mode!r}, inner_steps={h})",
                         figures={k: v for k, v in choice.items() if k != "why"})]
    mode = str(sync["mode"])
    if mode.startswith("auto"):
        return [Decision("sync", "step (auto's trial not finished)", 0, "the run ended before auto's timed steps",
                         "sync='step'")]
    return [Decision("sync", mode, 0, "every step's gradients are all-reduced (DDP)" if mode == "step"
                     else f"sync={mode!r} was set", f"sync={mode!r}", by="poise" if mode == "step" else "you")]


def _straggler(report: Mapping[str, Any]) -> list[Decision]:
    per_rank = report.get("straggler")
    if not isinstance(per_rank, list):
        return []
    on = any(isinstance(r, Mapping) for r in per_rank)
    return [Decision("straggler", "deadline steps" if on else "off", 0,
                     "straggler mode was set" if on else "no deadline steps: every rank finishes its share",
                     "straggler='deadline'" if on else "straggler='off'", by="you" if on else "poise")]


__all__ = ["MOVES", "SPLITS", "Decision", "decisions", "describe"]
