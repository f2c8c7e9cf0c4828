"""``poise bench balance``: static vs cost-aware vs dynamic sharding, side by side, with a slow rank.

Four real ``poise train`` jobs of code-lm on 2 workers, in one invocation:

(a) static: torch's DistributedSampler with fixed batches of ``--batch-size`` samples;
(b) cost: cost-budget batches with length bucketing, split by cost (equal speeds); the
    budget is the mean cost of ``--batch-size`` samples per rank, so every run sees the same
    real tokens per step on average and loss per token is comparable;
(c) dynamic, with rank 1 slowed to half speed (``--rank-speed 1:0.5``): speeds re-measured;
(d) static again with the same slow rank.

For each: balance (whole run and second half, after re-planning has converged), idle
fraction, real tokens/s (padding excluded), padding waste, and throughput against the ideal
(the sum of the ranks' own measured speeds). Training loss is compared at the same number of
real tokens, since the runs' batches differ. Re-planning runs every ``--replan-every`` steps
(default 10, shorter than the library default of 50) so that it converges within a run that
fits a 2-core machine; the JSON records it.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table

HELP = "static vs cost-aware vs dynamic sharding with a slow rank (code-lm, 2 workers)"


def loss_at_tokens(curve: list[list[float]], tokens: float, window: float = 0.1) -> float:
    """Mean training loss over the steps in the last ``window`` share of ``[0, tokens]`` real tokens.

    Averaging a window smooths step-to-step noise (batches differ in length and content).
    """
    points = np.asarray(curve)
    mask = (points[:, 0] <= tokens) & (points[:, 0] >= tokens * (1 - window))
    if not mask.any():
        mask = points[:, 0] <= tokens
    return float(points[mask, 1].mean())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=80, help="steps per run")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step (b, c: on average)")
    parser.add_argument("--slow-speed", type=float, default=0.5, help="speed of the slowed rank 1, in (0, 1]")
    parser.add_argument("--replan-every", type=int, default=10, help="(c): steps between re-plans")
    parser.add_argument("--window", type=int, default=20, help="(c): steps per speed estimate (20-100)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-balance-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every run, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "batch_size", "replan_every", "timeout_s")
    if not 0 < args.slow_speed <= 1:
        raise ValueError(f"--slow-speed={args.slow_speed} is outside (0, 1]")
    out = output_dir(args.out, "balance")
    common = ["--task", "code-lm", "--nproc", "2", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              *args.train_args]
    slow = ["--rank-speed", f"1:{args.slow_speed}"]
    runs: dict[str, list[str]] = {
        "a-static": ["--balance", "static"],
        "b-cost": ["--balance", "cost"],
        "c-dynamic-slow": ["--balance", "dynamic", *slow, "--balance.replan_every_steps", str(args.replan_every),
                           "--balance.window_steps", str(args.window)],
        "d-static-slow": ["--balance", "static", *slow],
    }
    reports = {name: run_train_job(name, out, [*common, *flags], args.timeout_s) for name, flags in runs.items()}
    common_tokens = min(r["loss_curve"][-1][0] for r in reports.values())
    rows: list[dict[str, Any]] = []
    for name, rep in reports.items():
        rows.append({
            "run": name,
            "balance": rep["balance"],
            "balance_last_half": rep["balance_last_half"],
            "idle_fraction": rep["idle_fraction"],
            "throughput_tokens_per_s": rep["throughput_tokens_per_s"],
            "ideal_tokens_per_s": rep["ideal_tokens_per_s"],
            "throughput_vs_ideal": rep["throughput_vs_ideal"],
            "padding_waste": rep["padding_waste"],
            "loss_at_common_tokens": loss_at_tokens(rep["loss_curve"], common_tokens),
            "eval_loss": rep["eval_loss"],
            "tokens_seen": rep["loss_curve"][-1][0],
            "slowdown": rep["emulated_slowdown"],
            "replans": rep["replans"],
        })
    show_table(
        f"poise bench balance: code-lm, 2 workers, {args.steps} steps; rank 1 at speed {args.slow_speed} in c, d",
        rows,
        [
            ("run", "run", str),
            ("balance", "balance", lambda v: f"{v:.3f}"),
            ("balance_last_half", "balance 2nd half", lambda v: f"{v:.3f}"),
            ("idle_fraction", "idle", lambda v: f"{v:.1%}"),
            ("throughput_tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
            ("throughput_vs_ideal", "vs ideal", lambda v: f"{v:.2f}"),
            ("padding_waste", "padding", lambda v: f"{v:.2f}"),
            ("loss_at_common_tokens", f"loss @ {common_tokens / 1e6:.2f}M tok", lambda v: f"{v:.3f}"),
            ("eval_loss", "eval bits/byte", lambda v: f"{v:.3f}"),
        ],
    )
    save_results(out, "balance", {
        "steps": args.steps, "common_tokens": common_tokens, "replan_every_steps": args.replan_every,
        "window_steps": args.window, "runs": rows, "flags": {k: [*common, *v] for k, v in runs.items()},
    })
    return 0
