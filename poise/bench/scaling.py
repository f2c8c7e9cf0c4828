"""``poise bench scaling``: the seed document's tuning checklist as one command.

1. Baseline: one worker, global batch B (its throughput is the reference).
2. Strong scaling: the same global batch B split over N workers (B/N each).
3. Weak scaling: N workers with B each (the global batch grows with N).

Each run is a real ``poise train`` job through the same launcher users run; the figures come
from its ``report.json``. Efficiency is throughput_N / (N × throughput_1), measured in real
tokens per second (samples differ in length, so samples/s would flatter short batches).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from poise.bench.harness import (
    output_dir,
    positive_ints,
    require_positive,
    run_train_job,
    save_results,
    show_table,
)

HELP = "single-worker baseline, strong and weak scaling"


@dataclass(frozen=True)
class ScalingRun:
    """One training job of a scaling study."""

    kind: str  # "baseline", "strong" or "weak"
    workers: int
    batch_size_per_worker: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.workers}w-b{self.batch_size_per_worker}"


def plan_runs(global_batch: int, worker_counts: list[int]) -> list[ScalingRun]:
    """The runs of a study: a 1-worker baseline, then strong and weak runs per worker count.

    Raises:
        ValueError: if a worker count does not divide the global batch (strong scaling
            must keep the global batch exactly).
    """
    runs = [ScalingRun("baseline", 1, global_batch)]
    for n in worker_counts:
        if n <= 1:
            continue
        if global_batch % n:
            raise ValueError(f"--global-batch={global_batch} is not divisible by {n} workers: pick a multiple")
        runs += [ScalingRun("strong", n, global_batch // n), ScalingRun("weak", n, global_batch)]
    return runs


def summarize(runs: list[ScalingRun], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run with throughput, speed-up and efficiency against the baseline."""
    base = reports[0]["throughput_tokens_per_s"]
    rows = []
    for run, rep in zip(runs, reports, strict=True):
        tput = rep["throughput_tokens_per_s"]
        rows.append({
            "run": run.name,
            "kind": run.kind,
            "workers": run.workers,
            "batch_size_per_worker": run.batch_size_per_worker,
            "global_batch": run.batch_size_per_worker * run.workers,
            "throughput_tokens_per_s": tput,
            "throughput_samples_per_s": rep["throughput_samples_per_s"],
            "median_step_s": rep["median_step_s"],
            "speedup": tput / base,
            "efficiency": tput / (base * run.workers),
            "balance": rep["balance"],
            "comm_fraction": rep["comm_fraction"],
            "idle_fraction": rep["idle_fraction"],
        })
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="code-lm", help="task to train (code-lm or digits)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (first step excluded from medians)")
    parser.add_argument("--global-batch", type=int, default=16, help="samples per step over all workers")
    parser.add_argument("--workers", default="2", help="comma-separated worker counts to compare with 1 worker")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-scaling-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "global_batch", "timeout_s")
    runs = plan_runs(args.global_batch, positive_ints(args.workers, "--workers"))
    out = output_dir(args.out, "scaling")
    train_args = ["--task", args.task, "--steps", str(args.steps), *args.train_args]
    reports = [
        run_train_job(r.name, out, [*train_args, "--nproc", str(r.workers), "--batch-size",
                                    str(r.batch_size_per_worker)], args.timeout_s)
        for r in runs
    ]
    rows = summarize(runs, reports)
    show_table(
        f"poise bench scaling: {args.task}, {args.steps} steps per run",
        rows,
        [
            ("run", "run", str),
            ("workers", "workers", str),
            ("global_batch", "global batch", str),
            ("throughput_tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
            ("throughput_samples_per_s", "samples/s", lambda v: f"{v:.1f}"),
            ("median_step_s", "median step", lambda v: f"{v * 1e3:.0f} ms"),
            ("speedup", "speed-up", lambda v: f"{v:.2f}x"),
            ("efficiency", "efficiency", lambda v: f"{v:.0%}"),
            ("comm_fraction", "comm", lambda v: f"{v:.1%}"),
            ("balance", "balance", lambda v: f"{v:.3f}"),
        ],
    )
    save_results(out, "scaling", {"task": args.task, "steps": args.steps, "train_args": train_args, "runs": rows})
    return 0
