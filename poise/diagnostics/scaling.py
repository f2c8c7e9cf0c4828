"""Strong and weak scaling runs: the seed document's tuning checklist as code.

1. Baseline: one worker, global batch B (its throughput is the reference).
2. Strong scaling: the same global batch B split over N workers (B/N each).
3. Weak scaling: N workers with B each (the global batch grows with N).

Each run is a real ``poise train`` job through the same launcher users run; the figures come
from its ``report.json``. Efficiency is throughput_N / (N × throughput_1), measured in real
tokens per second (samples differ in length, so samples/s would flatter short batches).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
            raise ValueError(f"global batch {global_batch} is not divisible by {n} workers: pick a multiple")
        runs += [ScalingRun("strong", n, global_batch // n), ScalingRun("weak", n, global_batch)]
    return runs


def run_job(run: ScalingRun, out_dir: Path, train_args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run one ``poise train`` job in a subprocess and return its report."""
    out = out_dir / run.name
    cmd = [
        sys.executable, "-m", "poise", "train", *train_args,
        "--nproc", str(run.workers), "--batch-size", str(run.batch_size_per_worker), "--out", str(out),
        "--diagnostics.progress", "false", "--diagnostics.plot", "false",
    ]
    log.info("scaling run %s: %s", run.name, " ".join(cmd[1:]))
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (log_path.read_text().strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"scaling run {run.name} failed (exit {proc.returncode}, see {log_path}): {tail}")
    return json.loads((out / "report.json").read_text())


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
