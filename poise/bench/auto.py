"""``poise bench auto``: poise with no settings against plain DDP and hand-picked poise, scenario by scenario.

What a user gets from ``poise train`` (or ``poise.Session(model, data)``) with no strategy
given, measured the way it is judged: the time to plain DDP's eval loss. Each scenario runs,
side by side on the emulated cluster of this machine (2 workers unless said):

- ``ddp``: plain DDP (``--balance static``: ``DistributedSampler``'s split, exact gradients,
  every step synchronized). It runs ``--steps`` steps, evaluating every ``--eval-every``; its
  final eval loss is the scenario's target and its schedule everyone's.
- ``auto``: poise with no setting at all.
- the scenario's hand-picked poise configurations (the grid), each the best a user who read
  the docs might choose for it.

Every run other than ``ddp`` keeps DDP's learning-rate schedule (``--train.schedule_steps``),
may take ``--extra-steps`` more steps and stops at the target. Per run: time to the target
(training seconds, evaluations left out), steps and real tokens to it, tokens/s over the run,
whole-run balance, padding per real token, what deciding the split cost (rank 0's seconds in
re-plans over the run's training seconds), and how many steps after each emulated change of
speed the per-step balance was back at ``RECOVERED_BALANCE`` (median of 3 steps). Per
scenario: ``auto``'s speed-up against ``ddp`` and its ratio to the best of the grid (the
targets: at least 0.98x DDP where there is nothing to fix, at least 1.0x DDP and within 5 %
of the best elsewhere), with medians over ``--seeds`` and their range.

Scenarios (code-lm, d_model 128, 2 layers, 16 sequences per rank per step):

- ``S1`` nothing to fix: equal ranks, near-equal lengths (samples cut at 64 bytes);
- ``S2`` rank 1 at half speed (slowed by sleeping, which holds on a loaded machine too);
- ``S3`` variable lengths, heavy padding (samples up to 512 bytes: DDP pads about 0.8 per real token);
- ``S6`` random stalls: every rank's compute stretched each step by 1 + X, X exponential with
  mean 0.2 (20 % on average, a heavy tail; sleeps, so it holds on a loaded machine too);
- ``S7`` rank 1 at half speed from a third of the run to two thirds, then recovered;
- ``S9`` rank 1 at half speed with variable lengths (the two together: the demo's case);
- ``S4``, ``S5`` 2 nodes over 1 Gbit/s, 100 Mbit/s links (root, ``ip`` and ``tc``; not by default);
- ``S8`` FSDP2 with rank 1 at half speed (not by default).

Each job is a real ``poise train`` (:func:`~poise.bench.harness.run_train_job`); the results
go to ``auto.json``, rewritten after every job (a bench stopped early keeps what it measured),
and one table at the end.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.bench.network import steps_to_target, time_to_target

HELP = "poise with no settings vs plain DDP vs hand-picked poise, scenario by scenario: time to DDP's eval loss"

MODEL = ("--task", "code-lm", "--task.d_model", "128", "--task.num_layers", "2", "--task.num_heads", "4",
         "--batch-size", "16", "--task.eval_max_samples", "128")
SLEEP = ("--emulate.slowdown_method", "sleep")
RECOVERED_BALANCE = 0.95  # a step's balance counted as recovered (the target)
RECOVERED_STEPS = 3  # ... as the median over this many steps


@dataclass(frozen=True)
class Scenario:
    """One case: its words, the flags every run of it shares (``steps`` is the reference's step
    count: a change of speed is placed by it), and its grid of hand-picked poise runs."""

    key: str
    words: str
    flags: Callable[[int], tuple[str, ...]]
    grid: dict[str, tuple[str, ...]]
    changes: Callable[[int], tuple[int, ...]] = lambda steps: ()  # steps where an emulated speed changes

    def runs(self) -> dict[str, tuple[str, ...]]:
        """Every run of the scenario, the reference first, then poise with no settings (its
        default said out loud: a bench job that names no ``--balance`` runs static sharding,
        :func:`~poise.bench.harness.run_train_job`)."""
        return {"ddp": ("--balance", "static", "--codec", "none"), "auto": ("--balance", "auto"), **self.grid}


BALANCING = {"cost": ("--balance", "cost"), "dynamic": ("--balance", "dynamic")}
# near-equal lengths leave length bucketing nothing to do: its runs there are DDP's with other samples
DYNAMIC = {"dynamic": ("--balance", "dynamic")}
CODECS = {"powersgd": ("--codec", "powersgd", "--comm.start_step", "5"), "fp16": ("--codec", "fp16")}
SCENARIOS: dict[str, Scenario] = {s.key: s for s in (
    Scenario("S1", "nothing to fix: equal ranks, near-equal lengths",
             lambda n: ("--task.max_seq_len", "64"), DYNAMIC),
    Scenario("S2", "rank 1 at half speed", lambda n: ("--task.max_seq_len", "64", "--rank-speed", "1:0.5", *SLEEP),
             DYNAMIC, lambda n: (0,)),
    Scenario("S3", "variable lengths, heavy padding", lambda n: ("--task.max_seq_len", "512"), BALANCING),
    Scenario("S7", "rank 1 at half speed from 1/3 to 2/3 of the run",
             lambda n: ("--task.max_seq_len", "64", "--rank-speed", f"1:0.5@{n // 3}-{2 * n // 3}", *SLEEP),
             DYNAMIC, lambda n: (n // 3, 2 * n // 3)),
    Scenario("S6", "random stalls, 20 % mean, every rank",
             lambda n: ("--task.max_seq_len", "64", "--emulate.speed_noise", "0.2"),
             {"deadline": ("--straggler", "deadline"), "dynamic": ("--balance", "dynamic")}),
    Scenario("S9", "rank 1 at half speed, variable lengths",
             lambda n: ("--task.max_seq_len", "512", "--rank-speed", "1:0.5", *SLEEP), BALANCING, lambda n: (0,)),
    Scenario("S4", "2 nodes over 1 Gbit/s", lambda n: ("--task.max_seq_len", "64", "--cluster", "2:1", "--link",
                                                       "1gbit"), CODECS),
    Scenario("S5", "2 nodes over 100 Mbit/s", lambda n: ("--task.max_seq_len", "64", "--cluster", "2:1", "--link",
                                                         "100mbit"), CODECS),
    Scenario("S8", "FSDP2, rank 1 at half speed",
             lambda n: ("--task.max_seq_len", "64", "--parallel", "fsdp", "--rank-speed", "1:0.5", *SLEEP),
             {"dynamic": ("--balance", "dynamic")}, lambda n: (0,)),
)}
DEFAULT_SCENARIOS = ("S2", "S9", "S1", "S7", "S3")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                        help=f"scenarios, comma-separated: {', '.join(SCENARIOS)} (S4, S5: root, ip and tc; "
                             f"default {','.join(DEFAULT_SCENARIOS)})")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated: medians and ranges over them")
    parser.add_argument("--steps", type=int, default=100, help="steps of the reference run (ddp)")
    parser.add_argument("--extra-steps", type=float, default=0.5,
                        help="the other runs may take this share more steps to reach the reference's loss")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (time to the loss)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-auto-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help=f"model flags after --, replacing ({' '.join(MODEL)})")


def parse(args: argparse.Namespace) -> tuple[list[Scenario], list[int]]:
    """The scenarios and seeds, or a one-line ValueError for the first bad flag."""
    require_positive(args, "steps", "eval_every", "timeout_s")
    if not (math.isfinite(args.extra_steps) and 0 <= args.extra_steps <= 10):
        raise ValueError(f"--extra-steps={args.extra_steps} must be in 0..10 (a share of --steps)")
    keys = [k.strip() for k in args.scenarios.split(",") if k.strip()]
    if not keys or any(k not in SCENARIOS for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"--scenarios={args.scenarios!r}: give distinct scenarios among {', '.join(SCENARIOS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={args.seeds!r} is invalid: give distinct seeds >= 0 separated by commas")
    return [SCENARIOS[k] for k in keys], seeds


def recovery_steps(balances: np.ndarray, at: int) -> int | None:
    """Steps from ``at`` until the per-step balance is back at :data:`RECOVERED_BALANCE`: the
    first ``k`` with the median of steps ``at + k .. at + k + 2`` at or above it; None when it
    never is. Pure."""
    for k in range(max(0, len(balances) - at - RECOVERED_STEPS + 1)):
        if float(np.median(balances[at + k: at + k + RECOVERED_STEPS])) >= RECOVERED_BALANCE:
            return k
    return None


def step_balances(run_dir: Path) -> np.ndarray:
    """Each step's balance (mean over slowest of the ranks' compute seconds) from a run's timeline."""
    from poise.diagnostics.timeline import column, load_table

    compute = column(load_table(run_dir / "timeline.npz"), "compute_s")
    slowest = compute.max(axis=0)
    return np.where(slowest > 0, compute.mean(axis=0) / np.where(slowest > 0, slowest, 1.0), 1.0)


def measure(report: dict[str, Any], run_dir: Path, target: float | None, changes: Sequence[int]) -> dict[str, Any]:
    """One run's figures from its report and timeline (see module doc)."""
    curve = report.get("eval_curve") or []
    steps = int(report["steps"])
    tokens = float(report["loss_curve"][-1][0]) if report.get("loss_curve") else float("nan")
    reached = steps_to_target(curve, target) if target is not None and curve else None
    balances = step_balances(run_dir)
    return {
        "steps": steps,
        "time_to_target_s": time_to_target(curve, target) if target is not None and curve else None,
        "steps_to_target": reached,
        "tokens_to_target": None if reached is None else tokens / steps * reached,
        "tokens_per_s": report.get("throughput_tokens_per_s"),
        "balance": report.get("balance"),
        "padding_waste": report.get("padding_waste"),
        "final_eval_loss": report.get("eval_loss"),
        "recovered_after_steps": [recovery_steps(balances, at) for at in changes if at < len(balances)],
        "decisions": len(report.get("decisions") or []),
        # the codec in force and from which step ([step, choice], ...): poise's own where none was named
        "codec_decisions": [[d.get("step"), d.get("choice")] for d in report.get("decisions") or []
                            if d.get("knob") == "comm.codec"],
        # what deciding the split cost, over the run's training seconds: rank 0's seconds in
        # re-plans (the gather's wait for the last rank included: an upper bound), and in deciding
        "replan_share": _share(report.get("replan_s"), curve),
        "decide_share": _share(report.get("replan_decide_s"), curve),
    }


def _share(seconds: float | None, curve: Sequence[dict[str, float]]) -> float | None:
    """``seconds`` over the run's training seconds (its last evaluation's), or None."""
    if seconds is None or not curve or curve[-1]["train_s"] <= 0:
        return None
    return float(seconds) / float(curve[-1]["train_s"])


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and run: medians over seeds with [min, max], then ``auto`` against ``ddp``
    (its time to DDP's loss over auto's) and against the best of the grid. Pure."""
    out: list[dict[str, Any]] = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == scenario]
        per_run: dict[str, dict[str, Any]] = {}
        for run in dict.fromkeys(r["run"] for r in mine):
            seeds = [r for r in mine if r["run"] == run]
            row: dict[str, Any] = {"scenario": scenario, "run": run, "seeds": len(seeds),
                                   "command": seeds[0]["command"]}
            for key in ("time_to_target_s", "tokens_to_target", "tokens_per_s", "balance", "padding_waste",
                        "final_eval_loss", "replan_share", "decide_share"):
                values = [r[key] for r in seeds if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
                row[f"{key}_range"] = [min(values), max(values)] if values else None
            row["reached"] = sum(r["time_to_target_s"] is not None for r in seeds)
            row["recovered_after_steps"] = [r["recovered_after_steps"] for r in seeds]
            per_run[run] = row
        ddp, auto = per_run.get("ddp"), per_run.get("auto")
        grid = [r for k, r in per_run.items() if k not in ("ddp", "auto") and r["time_to_target_s"]]
        best = min(grid, key=lambda r: r["time_to_target_s"]) if grid else None
        for row in per_run.values():
            if ddp and ddp["time_to_target_s"] and row["time_to_target_s"]:
                row["speedup_vs_ddp"] = ddp["time_to_target_s"] / row["time_to_target_s"]
            if ddp and ddp["tokens_to_target"] and row["tokens_to_target"]:
                row["tokens_vs_ddp"] = row["tokens_to_target"] / ddp["tokens_to_target"]
        if auto is not None and best is not None and auto["time_to_target_s"]:
            auto["best_hand_picked"] = best["run"]
            auto["vs_best"] = best["time_to_target_s"] / auto["time_to_target_s"]
        out.extend(per_run.values())
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = [
    ("scenario", "scenario", str), ("run", "run", str),
    ("time_to_target_s", "time to DDP's loss (s)", lambda v: _fmt(v, ".1f")),
    ("speedup_vs_ddp", "vs DDP", lambda v: _fmt(v, ".2f") + "x" if v is not None else "-"),
    ("vs_best", "vs best hand-picked", lambda v: _fmt(v, ".2f") + "x" if v is not None else "-"),
    ("best_hand_picked", "best", str),
    ("tokens_vs_ddp", "tokens to it vs DDP", lambda v: _fmt(v, ".2f") + "x" if v is not None else "-"),
    ("tokens_per_s", "tokens/s", lambda v: _fmt(v, ",.0f")),
    ("balance", "balance", lambda v: _fmt(v, ".3f")),
    ("padding_waste", "padding/token", lambda v: _fmt(v, ".2f")),
    ("replan_share", "re-plans", lambda v: "-" if not v else f"{v:.1%}"),
    ("decide_share", "deciding", lambda v: "-" if not v else f"{v:.1%}"),
    ("reached", "seeds at target", str),
]


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as the Markdown table docs/decide.md quotes (medians, with the range over
    seeds of the time to DDP's loss), so that the page is written from the results file and a
    test can check that it still says what the file says. Pure."""
    def ratio(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = ["| scenario | run | time to DDP's loss, s (range) | vs DDP | vs best hand-picked | tokens to it vs DDP "
             "| tokens/s | balance | padding per token | seeds at DDP's loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in summary:
        span = row.get("time_to_target_s_range")
        time_s = "not reached" if row.get("time_to_target_s") is None else (
            f"{row['time_to_target_s']:.1f} ({span[0]:.1f}-{span[1]:.1f})")
        best = f"{ratio(row.get('vs_best'))} ({row['best_hand_picked']})" if row.get("vs_best") is not None else "-"
        lines.append(" | ".join([
            f"| {row['scenario']}", row["run"], time_s, ratio(row.get("speedup_vs_ddp")), best,
            ratio(row.get("tokens_vs_ddp")), _fmt(row.get("tokens_per_s"), ",.0f"), _fmt(row.get("balance"), ".3f"),
            _fmt(row.get("padding_waste"), ".2f"), f"{row['reached']}/{row['seeds']} |"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    scenarios, seeds = parse(args)
    model = list(args.train_args) or list(MODEL)
    out = output_dir(args.out, "auto")
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every job: a long bench stopped early keeps what it measured
        save_results(out, "auto", {"steps": args.steps, "extra_steps": args.extra_steps, "seeds": seeds,
                                   "scenarios": {s.key: s.words for s in scenarios}, "runs": rows,
                                   "summary": summarize(rows)})

    for scenario in scenarios:
        changes = scenario.changes(args.steps)
        for seed in seeds:
            target: float | None = None
            for label, extra in scenario.runs().items():
                steps = args.steps if label == "ddp" else math.ceil(args.steps * (1 + args.extra_steps))
                flags = [*model, *scenario.flags(args.steps), "--steps", str(steps), "--seed", str(seed),
                         "--train.eval_every", str(args.eval_every), *extra]
                if label != "ddp":
                    flags += ["--train.schedule_steps", str(args.steps)]
                    if target is not None:
                        flags += ["--train.stop_at_eval_loss", repr(target)]
                name = f"{scenario.key}-{label}-seed{seed}"
                report = run_train_job(name, out, flags, args.timeout_s)
                if label == "ddp":
                    target = float(report["eval_loss"])
                rows.append({"scenario": scenario.key, "words": scenario.words, "run": label, "seed": seed,
                             "command": "poise train " + " ".join(flags), "target_eval_loss": target,
                             **measure(report, out / name, target, changes)})
                save()
    show_table(f"poise bench auto: time to plain DDP's eval loss, medians over seeds {args.seeds}", summarize(rows),
               COLUMNS)
    return 0
