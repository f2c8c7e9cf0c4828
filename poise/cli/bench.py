"""``poise bench <family>``: run a benchmark, print a table, write JSON.

Speed claims live here, never in tests: each family measures the configurations it compares
side by side in one invocation and reports medians and ratios.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise.diagnostics import scaling
from poise.files import write_json_atomic
from poise.log import make_console


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("bench", help="run a benchmark: prints a table and writes JSON")
    families = parser.add_subparsers(dest="family", required=True, parser_class=type(parser))
    sc = families.add_parser("scaling", help="single-worker baseline, strong and weak scaling")
    sc.add_argument("--task", default="code-lm", help="task to train (code-lm or digits)")
    sc.add_argument("--steps", type=int, default=30, help="steps per run (first step excluded from medians)")
    sc.add_argument("--global-batch", type=int, default=16, help="samples per step over all workers (strong scaling)")
    sc.add_argument("--workers", default="2", help="comma-separated worker counts to compare with 1 worker")
    sc.add_argument("--timeout-s", type=float, default=900.0, help="limit per run, seconds")
    sc.add_argument("--out", default="", help="output directory (default runs/bench-scaling-<timestamp>)")
    sc.add_argument("train_args", nargs="*", help="extra 'poise train' flags, after --")
    sc.set_defaults(run=run_scaling)


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{what}={text!r} is invalid: give positive integers separated by commas")
    return values


def run_scaling(args: argparse.Namespace) -> int:
    from rich.table import Table

    for name in ("steps", "global_batch"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    workers = _positive_ints(args.workers, "--workers")
    runs = scaling.plan_runs(args.global_batch, workers)
    out = Path(args.out or Path("runs") / time.strftime("bench-scaling-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    train_args = ["--task", args.task, "--steps", str(args.steps), *args.train_args]
    console = make_console()
    reports = []
    for run in runs:
        console.print(f"running {run.name} ...")
        reports.append(scaling.run_job(run, out, train_args, args.timeout_s))
    rows = scaling.summarize(runs, reports)

    table = Table(title=f"poise bench scaling: {args.task}, {args.steps} steps per run")
    headers: dict[str, Callable[[Any], str]] = {
        "run": str, "workers": str, "global_batch": str,
        "throughput_tokens_per_s": lambda v: f"{v:,.0f}",
        "throughput_samples_per_s": lambda v: f"{v:.1f}",
        "median_step_s": lambda v: f"{v * 1e3:.0f} ms",
        "speedup": lambda v: f"{v:.2f}x",
        "efficiency": lambda v: f"{v:.0%}",
        "comm_fraction": lambda v: f"{v:.1%}",
        "balance": lambda v: f"{v:.3f}",
    }
    for h in headers:
        table.add_column(h.replace("throughput_", "").replace("_", " "), justify="right")
    for row in rows:
        table.add_row(*(fmt(row[h]) for h, fmt in headers.items()))
    console.print(table)
    path = write_json_atomic({"bench": "scaling", "task": args.task, "steps": args.steps, "runs": rows,
                       "train_args": train_args}, out / "scaling.json")
    console.print(f"wrote {path}")
    return 0
