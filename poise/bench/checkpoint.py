"""``poise bench checkpoint``: what checkpoints cost: stall, bytes, restore time, share of training.

Real ``poise train`` jobs of code-lm on 2 workers, side by side in one invocation:

(a) no checkpoints: the baseline step time;
(b) sync, full saves every ``--every`` steps: the loop waits for the whole write;
(c) async, full saves: the loop waits for the in-memory snapshot only;
(d) async, differential saves (a full base every ``--full-every`` saves);
(e) fine-tuning with most layers frozen (``--frozen``), async full saves;
(f) the same, differential: only the tensors that changed are written;
(g) as (d), with int8 deltas (``--checkpoint.delta_codec int8``): in full training every tensor
    changes, so (d)'s differential saves are full-size; (g) writes each change since the last
    save int8-encoded, about a quarter, and restores within the largest error it logs.

Per run: median seconds of a step, median stall per checkpoint (seconds the training loop
was held up), median write seconds (snapshot end to checkpoint in place), median bytes
written per checkpoint (full base and differential saves apart), the stall and the overhead
as shares of training time (the run's median step × steps) at this run's interval, the
overhead being the stall plus, for async runs, the background write seconds (an upper bound:
on shared cores the writer can take at most that much from training), and the stall
projected to a checkpoint every 50 steps. Restore seconds (find the newest good checkpoint, verify every
file, compose and read it) are measured here, in one process, on each run's last checkpoint.
The frozen-layers ratio compares (f)'s differential saves with its own full bases.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.checkpoint import layout
from poise.log import make_console

HELP = "checkpoint stall, bytes (full vs differential, frozen layers), restore time (code-lm, 2 workers)"
# Fine-tuning: the embeddings and every transformer block stay fixed; the final norm and the head train.
FROZEN = "token_embedding,position_embedding,blocks"
PROJECT_EVERY_STEPS = 50
RUNS = ("a-none", "b-sync-full", "c-async-full", "d-async-diff", "e-frozen-full", "f-frozen-diff", "g-async-int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints in (b)-(f)")
    parser.add_argument("--full-every", type=int, default=4, help="(d), (f): every this many saves is a full base")
    parser.add_argument("--frozen", default=FROZEN, help="(e), (f): parameter-name prefixes kept fixed")
    parser.add_argument("--runs", default=",".join(RUNS), help="runs to do, comma-separated (a-none always runs)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-checkpoint-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every run, after --")


def restore_s(root: Path) -> float:
    """Seconds to find, verify and read the newest checkpoint under ``root`` (model, optimizer, state)."""
    start = time.perf_counter()
    found = layout.newest_good(root)
    if found is None:
        raise RuntimeError(f"no good checkpoint under {root}")
    name, manifest = found
    layout.load_tensors(root, manifest, "model")
    layout.load_tensors(root, manifest, "optim")
    layout.load_file(root / name / "state.pt")
    layout.load_file(root / name / layout.rank_file(0))
    return time.perf_counter() - start


def summarize(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """One table row from a run's report (see module doc for each figure)."""
    row: dict[str, Any] = {"run": name, "step_s": report["median_step_s"]}
    saves = (report.get("checkpoints") or {}).get("saves") or []
    if not saves:
        return row
    stall = np.array([s["stall_s"] for s in saves])
    write = np.array([s["write_s"] for s in saves])
    step_s = report["median_step_s"]  # the loop's stall is outside the step, so not in it
    train_s = step_s * report["steps"]
    # An async write can take at most its own seconds of CPU from training (on shared cores);
    # comparing step times across runs instead would measure the neighbours' load.
    background_s = float(write.sum()) if report["config"]["checkpoint"].get("async_save", True) else 0.0
    full = [s["bytes_written"] for s in saves if s["kind"] == "full"]
    diff = [s["bytes_written"] for s in saves if s["kind"] == "differential"]
    row.update({
        "saves": len(saves),
        "stall_s": float(np.median(stall)),
        "write_s": float(np.median(write)),
        "full_bytes": float(np.median(full)) if full else None,
        "diff_bytes": float(np.median(diff)) if diff else None,
        "stall_share": float(stall.sum() / train_s),
        "overhead_share": float((stall.sum() + background_s) / train_s),
        "stall_share_at_50": float(np.median(stall) / (PROJECT_EVERY_STEPS * step_s)),
        "max_error": max(s.get("max_error", 0.0) for s in saves),
    })
    if full and diff:
        row["diff_vs_full"] = float(np.median(diff) / np.median(full))
    return row


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "every", "full_every", "timeout_s")
    chosen = {"a-none", *(r.strip() for r in args.runs.split(",") if r.strip())}
    unknown = sorted(chosen - set(RUNS))
    if unknown:
        raise ValueError(f"--runs: {', '.join(unknown)} unknown: allowed are {', '.join(RUNS)}")
    out = output_dir(args.out, "checkpoint")
    common = ["--task", "code-lm", "--nproc", "2", "--steps", str(args.steps), *args.train_args]
    every = ["--checkpoint-every", str(args.every), "--checkpoint.full_every", str(args.full_every)]
    frozen = ["--train.frozen", args.frozen]
    runs: dict[str, list[str]] = {
        "a-none": [],
        "b-sync-full": [*every, "--no-checkpoint-async", "--no-checkpoint-differential"],
        "c-async-full": [*every, "--checkpoint-async", "--no-checkpoint-differential"],
        "d-async-diff": [*every, "--checkpoint-async", "--checkpoint-differential"],
        "e-frozen-full": [*every, *frozen, "--checkpoint-async", "--no-checkpoint-differential"],
        "f-frozen-diff": [*every, *frozen, "--checkpoint-async", "--checkpoint-differential"],
        "g-async-int8": [*every, "--checkpoint-async", "--checkpoint-differential", "--checkpoint.delta_codec", "int8"],
    }
    runs = {name: flags for name, flags in runs.items() if name in chosen}
    reports = {name: run_train_job(name, out, [*common, *flags], args.timeout_s) for name, flags in runs.items()}
    rows = [summarize(name, rep) for name, rep in reports.items()]
    for row in rows:
        if row["run"] != "a-none":
            row["restore_s"] = restore_s(out / row["run"] / "checkpoints")
    by_run = {r["run"]: r for r in rows}
    # the frozen run's own full bases against its differential saves
    frozen = by_run.get("f-frozen-diff", {})
    frozen_full, frozen_diff = frozen.get("full_bytes"), frozen.get("diff_bytes")
    mb = lambda v: "-" if v is None else f"{v / 1e6:.2f}"  # noqa: E731
    show_table(
        f"poise bench checkpoint: code-lm, 2 workers, {args.steps} steps, a checkpoint every {args.every} steps",
        rows,
        [
            ("run", "run", str),
            ("step_s", "step ms", lambda v: f"{v * 1e3:.0f}"),
            ("stall_s", "stall ms", lambda v: f"{v * 1e3:.1f}"),
            ("write_s", "write s", lambda v: f"{v:.2f}"),
            ("full_bytes", "full MB", mb),
            ("diff_bytes", "diff MB", mb),
            ("diff_vs_full", "diff/full", lambda v: f"{v:.1%}"),
            ("restore_s", "restore s", lambda v: f"{v:.2f}"),
            ("max_error", "max error", lambda v: "exact" if v == 0 else f"{v:.1e}"),
            ("stall_share", "stall share", lambda v: f"{v:.2%}"),
            ("overhead_share", "overhead", lambda v: f"{v:.2%}"),
            ("stall_share_at_50", "stall @50", lambda v: f"{v:.2%}"),
        ],
    )
    ratio = frozen_diff / frozen_full if frozen_full and frozen_diff else None
    async_at_50 = by_run.get("c-async-full", {}).get("stall_share_at_50")
    make_console().print(
        f"targets: async stall at a checkpoint every {PROJECT_EVERY_STEPS} steps "
        f"{'-' if async_at_50 is None else f'{async_at_50:.2%}'} of step time (< 3%); "
        f"frozen-layers differential {'-' if ratio is None else f'{ratio:.1%}'} of full (<= 10%)"
    )
    save_results(out, "checkpoint", {
        "steps": args.steps, "every_steps": args.every, "full_every": args.full_every, "frozen": args.frozen,
        "runs": rows, "frozen_diff_vs_full": ratio, "async_stall_share_at_50": async_at_50,
        "flags": {k: [*common, *v] for k, v in runs.items()},
    })
    return 0
