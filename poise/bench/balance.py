"""``poise bench balance``: static vs cost-aware vs dynamic sharding, side by side, with a slow rank.

Nine real ``poise train`` jobs of code-lm on 2 workers, in one invocation, every one with the
library's defaults (what a user gets):

(a) static: torch's DistributedSampler with fixed batches of ``--batch-size`` samples;
(b) cost: cost-budget batches with length bucketing, split by cost (equal speeds); the
    budget is the mean cost of ``--batch-size`` samples per rank, so every run sees the same
    real tokens per step on average and loss per token is comparable;
(c) dynamic, with rank 1 slowed to half speed (``--rank-speed 1:0.5``): speeds re-measured;
(d) static again with the same slow rank;
(e) dynamic, rank 1 at full speed until step ``--change-at``, then at half speed
    (``1:0.5@STEP``): a device that degrades mid-run;
(f) dynamic, rank 1 at half speed and every rank's compute stretched each step by 1 + X,
    X exponential with mean ``--noise`` (noisy speeds; sleeps).

Then the balancer with deadline steps (``--straggler deadline``, ``poise/straggler/``) under
``--delays`` (transient delays, default a mean-normalised lognormal at 20 %): persistent
slowness should move the shares, transient delays should be met by the deadline and leave
them alone:

(g) dynamic + deadline, rank 1 at half speed, with the delays;
(h) static + deadline, the same: the deadline alone (the fast rank takes the slow one's
    micro-batches within each step, every step);
(i) dynamic + deadline, equal speeds, with the delays: the shares should stay near equal.

Under a deadline every rank computes until about the same moment (within about one
micro-batch: a quarter of a step with the default 4), so the per-step balance reads much the
same whatever the shares; what tells these runs apart is rank 1's share of the last plan, the
share of micro-batches other ranks took over from a rank's own list, the share deferred to a
later step, and the throughput against the ideal (tokens/s differ by padding: static batches
are padded to their longest sample).

For each: balance (whole run and second half), when it converged (:func:`converged_at`: the
first step from which the median balance of the next ``CONVERGED_WINDOW`` steps is at least
``--target``), the balance from then on, the balance from ``SETTLE_STEPS`` steps after the
cold start (e: after the change) to the end (what "converged within 20 steps" asks of), the
ceiling over those steps (what a perfect plan would reach given how much one step's time
strays from its cost model: :func:`~poise.balance.metrics.balance_ceiling`), how
often the re-planner reversed the direction of a share (oscillation), idle fraction, real
tokens/s (padding excluded), padding waste, and throughput against the ideal (the sum of the
ranks' own measured speeds). Training loss is compared at the same number of real tokens,
since the runs' batches differ. ``--runs`` picks some of them (e.g. ``c,e``).

``--repeats N`` runs every job N times, interleaved (a, b, c, a, b, c, ...) so that the
machine's drift falls on every run alike, and adds one row per run with the median of each
figure over its repeats. Why: one step's balance is bounded by how much one step's compute
varies on the machine, and that varies from run to run: on one 2-core machine the same
code read 0.955 and 0.920 for (b) twenty minutes apart (``runs/s38-abc``, ``runs/s38-bcef``).
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any

import numpy as np

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.diagnostics.report import balance_ceiling_of
from poise.diagnostics.timeline import load_table

HELP = "static vs cost-aware vs dynamic sharding with a slow rank, and with deadline steps (code-lm, 2 workers)"


def loss_at_tokens(curve: list[list[float]], tokens: float, window: float = 0.1) -> float:
    """Mean training loss over the steps in the last ``window`` share of ``[0, tokens]`` real tokens.

    Averaging a window smooths step-to-step noise (batches differ in length and content).
    """
    points = np.asarray(curve)
    mask = (points[:, 0] <= tokens) & (points[:, 0] >= tokens * (1 - window))
    if not mask.any():
        mask = points[:, 0] <= tokens
    return float(points[mask, 1].mean())


CONVERGED_WINDOW = 10  # steps whose median balance must reach the target
SETTLE_STEPS = 20  # the target: converged within this many steps after the cold start


def converged_at(per_step: list[float], start: int, target: float, window: int = CONVERGED_WINDOW) -> int | None:
    """The first step at or after ``start`` from which the median balance of the next
    ``window`` steps is at least ``target`` (None: never). One step's balance is noisy (its
    batches differ), so a single good step does not count."""
    values = np.asarray(per_step, dtype=np.float64)
    for s in range(start, len(values) - window + 1):
        if float(np.median(values[s : s + window])) >= target:
            return s
    return None


def reversals(replans: list[dict[str, Any]]) -> int:
    """How often rank 0's share changed direction from one re-plan to the next (oscillation)."""
    shares = [0.5] + [e["shares"][0] for e in replans]
    moves = [b - a for a, b in itertools.pairwise(shares) if abs(b - a) > 1e-9]
    return sum(1 for a, b in itertools.pairwise(moves) if a * b < 0)


def deadline_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Rank 1's share of the last plan (0.5 before any re-plan; of the step's cost), and for
    deadline steps the share of the ranks' planned micro-batches that another rank took over
    and that were deferred to a later step (None without a deadline)."""
    shares = report["replans"][-1]["shares"] if report["replans"] else [0.5, 0.5]
    ranks = [r for r in report.get("straggler") or [] if r is not None and r["mode"] != "off"]
    planned = sum(r["micro_planned"] for r in ranks)
    return {
        "rank1_share": float(shares[1]),
        "taken_over": sum(r["micro_taken_over"] for r in ranks) / planned if planned else None,
        "deferred": sum(r["micro_deferred"] for r in ranks) / planned if planned else None,
    }


def median_row(run: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row with the median over ``rows`` (repeats of one run) of every numeric figure.

    A figure that is None in some repeats (no deadline, never converged) is None in the
    median when it is None in at least half of them, otherwise the median of the known ones;
    for the steps to converge, "never" counts as later than any step.
    """
    out: dict[str, Any] = {"run": run, "repeats": len(rows)}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            continue
        known = [v for v in values if v is not None]
        if key == "converged_after_steps":  # never: later than any step
            steps = float(np.median([math.inf if v is None else v for v in values]))
            out[key] = None if math.isinf(steps) else steps
        else:
            out[key] = float(np.median(known)) if 2 * len(known) > len(values) else None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=150, help="steps per run")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (b, c: on average)")
    parser.add_argument("--slow-speed", type=float, default=0.5, help="speed of the slowed rank 1, in (0, 1]")
    parser.add_argument("--change-at", type=int, default=80, help="(e): the step rank 1 slows down at")
    parser.add_argument("--noise", type=float, default=0.3, help="(f): mean per-step stretch of every rank's compute")
    parser.add_argument("--delays", default="lognormal:mean=0.2,sigma=1",
                        help="(g-i): the transient delays injected (poise train --delay)")
    parser.add_argument("--target", type=float, default=0.95, help="balance that counts as converged")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
    parser.add_argument("--runs", default="a,b,c,d,e,f,g,h,i",
                        help="which runs, by letter (a-i, comma-separated): e.g. c,e for the dynamic targets alone")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every job this many times, interleaved, and add the median of each figure")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-balance-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every run, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "batch_size", "change_at", "timeout_s", "repeats")
    if not 0 < args.slow_speed <= 1:
        raise ValueError(f"--slow-speed={args.slow_speed} is outside (0, 1]")
    out = output_dir(args.out, "balance")
    common = ["--task", "code-lm", "--nproc", "2", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              *args.train_args]
    slow = ["--rank-speed", f"1:{args.slow_speed}"]
    deadline = ["--straggler", "deadline", "--delay", args.delays]
    runs: dict[str, list[str]] = {
        "a-static": ["--balance", "static"],
        "b-cost": ["--balance", "cost"],
        "c-dynamic-slow": ["--balance", "dynamic", *slow],
        "d-static-slow": ["--balance", "static", *slow],
        "e-dynamic-change": ["--balance", "dynamic", "--rank-speed", f"1:{args.slow_speed}@{args.change_at}"],
        "f-dynamic-noisy": ["--balance", "dynamic", *slow, "--emulate.speed_noise", str(args.noise)],
        "g-dynamic-deadline-slow": ["--balance", "dynamic", *slow, *deadline],
        "h-static-deadline-slow": ["--balance", "static", *slow, *deadline],
        "i-dynamic-deadline": ["--balance", "dynamic", *deadline],
    }
    letters = [x.strip() for x in args.runs.split(",") if x.strip()]
    if not letters or any(x not in [name[0] for name in runs] for x in letters):
        raise ValueError(f"--runs={args.runs!r}: allowed are the letters a-i, comma-separated (e.g. c,e)")
    runs = {name: flags for name, flags in runs.items() if name[0] in letters}
    jobs = [(name if args.repeats == 1 else f"{name}-{k + 1}", name)
            for k in range(args.repeats) for name in runs]  # interleaved: a, b, a, b, ...
    reports = {job: run_train_job(job, out, [*common, *runs[name]], args.timeout_s) for job, name in jobs}
    common_tokens = min(r["loss_curve"][-1][0] for r in reports.values())
    rows: list[dict[str, Any]] = []
    for job, name in jobs:
        rep = reports[job]
        per_step = rep["balance_per_step"]
        cold = int(rep["config"]["balance"]["cold_start_steps"]) if "dynamic" in name else 1
        start = args.change_at if name.startswith("e-") else cold
        at = converged_at(per_step, start, args.target)
        rows.append({
            "run": job,
            "balance": rep["balance"],
            "balance_last_half": rep["balance_last_half"],
            # steps after the cold start (e: after the change) until converged; None: never
            "converged_after_steps": None if at is None else at - start,
            "balance_after_converged": float(np.mean(per_step[at:])) if at is not None else None,
            # None: the run ends within SETTLE_STEPS steps of the cold start (or the change)
            "balance_settled": float(np.mean(settled)) if (settled := per_step[start + SETTLE_STEPS:]) else None,
            "balance_settled_median": float(np.median(settled)) if settled else None,
            # what a perfect plan would reach over the same steps: the per-step noise's limit
            "balance_ceiling_settled": balance_ceiling_of(
                load_table(out / job / "timeline.npz")[:, start + SETTLE_STEPS:]),
            "share_reversals": reversals(rep["replans"]),
            "idle_fraction": rep["idle_fraction"],
            "throughput_tokens_per_s": rep["throughput_tokens_per_s"],
            "ideal_tokens_per_s": rep["ideal_tokens_per_s"],
            "throughput_vs_ideal": rep["throughput_vs_ideal"],
            "padding_waste": rep["padding_waste"],
            "loss_at_common_tokens": loss_at_tokens(rep["loss_curve"], common_tokens),
            "eval_loss": rep["eval_loss"],
            "tokens_seen": rep["loss_curve"][-1][0],
            **deadline_figures(rep),
            "slowdown": rep["emulated_slowdown"],
            "replans": rep["replans"],
        })
    if args.repeats > 1:
        rows += [median_row(f"{name} (median of {args.repeats})", [r for (job, n), r in zip(jobs, rows, strict=True)
                                                                   if n == name]) for name in runs]
    show_table(
        f"poise bench balance: code-lm, 2 workers, {args.steps} steps, library defaults; rank 1 at speed "
        f"{args.slow_speed} in c, d, f, g, h, from step {args.change_at} in e; f: noise {args.noise}; "
        f"g-i: deadline steps under {args.delays}",
        rows,
        [
            ("run", "run", str),
            ("balance", "balance", lambda v: f"{v:.3f}"),
            ("balance_last_half", "balance 2nd half", lambda v: f"{v:.3f}"),
            ("converged_after_steps", f"steps to {args.target}", lambda v: "never" if v is None else f"{v:g}"),
            ("balance_after_converged", "balance then", lambda v: "-" if v is None else f"{v:.3f}"),
            ("balance_settled", f"from {SETTLE_STEPS} on", lambda v: "-" if v is None else f"{v:.3f}"),
            ("balance_settled_median", "(median)", lambda v: "-" if v is None else f"{v:.3f}"),
            ("balance_ceiling_settled", "ceiling", lambda v: "-" if v is None else f"{v:.3f}"),
            ("share_reversals", "reversals", str),
            ("idle_fraction", "idle", lambda v: f"{v:.1%}"),
            ("throughput_tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
            ("throughput_vs_ideal", "vs ideal", lambda v: f"{v:.2f}"),
            ("padding_waste", "padding", lambda v: f"{v:.2f}"),
            ("rank1_share", "rank 1 share", lambda v: f"{v:.3f}"),
            ("taken_over", "taken over", lambda v: "-" if v is None else f"{v:.1%}"),
            ("deferred", "deferred", lambda v: "-" if v is None else f"{v:.1%}"),
            ("loss_at_common_tokens", f"loss @ {common_tokens / 1e6:.2f}M tok", lambda v: f"{v:.3f}"),
            ("eval_loss", "eval bits/byte", lambda v: f"{v:.3f}"),
        ],
    )
    save_results(out, "balance", {
        "steps": args.steps, "common_tokens": common_tokens, "target": args.target,
        "converged_window_steps": CONVERGED_WINDOW, "change_at": args.change_at, "noise": args.noise,
        "repeats": args.repeats,
        "runs": rows, "flags": {k: [*common, *v] for k, v in runs.items()},
    })
    return 0
