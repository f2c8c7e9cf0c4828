"""``poise bench network``: all-reduce algorithms and gradient codecs over real, rate-shaped links.

For each link rate (100 Mbit/s, 1 Gbit/s and 10 Gbit/s by default) an emulated cluster of
``--nodes`` nodes × ``--procs-per-node`` workers (network namespaces behind tbf-shaped links,
``poise cluster``) runs, side by side:

1. ``poise diagnose busbw`` of flat (gloo's own), ring and hierarchical all-reduce at one size
   (64 MB): time, busbw with the nccl-tests convention and its ratio to the line rate. busbw
   assumes every rank's data crosses the network (2(n-1)/n of it per rank), so an algorithm
   that sends less over the slow links (hierarchical: one copy per node) can show a busbw above
   the line rate: the ratio then says how much faster than a flat ring at full line rate it is.
2. The same training job (code-lm widened to ~19M parameters by default, few tokens per step
   so that communication, not the 2 shared cores, sets the pace) with plain DDP, torch's fp16
   and PowerSGD hooks, and poise's codecs and collectives: median step, tokens/s, speed-up
   over plain DDP and over torch's PowerSGD, bytes per step, and the eval loss at the same
   number of steps. "MB sent/step" is what a rank hands to its collectives (after a codec);
   for hierarchical runs that is the uncompressed traffic inside the node, while the codec
   works on what crosses between nodes.

The cluster needs root (``ip``, ``tc``); each job brings its own cluster up and down.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.cluster.links import link_rate_bit_per_s

HELP = "flat/ring/hierarchical busbw and training with each codec over shaped links on an emulated cluster"

# (label, poise train flags): plain DDP first (the reference), torch's hooks, then poise's
RUNS: dict[str, tuple[str, ...]] = {
    "ddp": ("--codec", "none"),
    "torch-fp16": ("--codec", "torch-fp16"),
    "torch-powersgd": ("--codec", "torch-powersgd"),
    "none+hierarchical": ("--codec", "none", "--collective", "hierarchical"),
    "fp16+hierarchical": ("--codec", "fp16", "--collective", "hierarchical"),
    "sign": ("--codec", "sign"),
    "sign+hierarchical": ("--codec", "sign", "--collective", "hierarchical"),
    "topk": ("--codec", "topk"),
    "powersgd": ("--codec", "powersgd"),
}
BUSBW_OPS = ("all_reduce", "poise-ring", "poise-hierarchical")
MODEL_ARGS = ("--task", "code-lm", "--task.d_model", "512", "--task.num_layers", "6", "--task.num_heads", "8",
              "--max-seq-len", "32", "--batch-size", "1", "--task.eval_max_samples", "128")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--links", default="100mbit,1gbit,10gbit", help="link rates, comma-separated")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    parser.add_argument("--procs-per-node", type=int, default=2, help="workers per node")
    parser.add_argument("--busbw-bytes", default="64M", help="all-reduce size of the busbw part ('' skips it)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"training runs: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=20, help="steps per training run")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-network-<timestamp>)")
    parser.add_argument("train_args", nargs="*",
                        help="'poise train' flags after --, replacing the default model "
                             f"({' '.join(MODEL_ARGS)})")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "nodes", "procs_per_node", "steps", "timeout_s")
    links = [t.strip() for t in args.links.split(",") if t.strip()]
    for link in links:
        link_rate_bit_per_s(link)  # one-line error for a bad rate, before anything starts
    labels = [t.strip() for t in args.runs.split(",") if t.strip()]
    unknown = [x for x in labels if x not in RUNS]
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(unknown)}; allowed are {', '.join(RUNS)}")
    model = list(args.train_args) or list(MODEL_ARGS)
    cluster = f"{args.nodes}:{args.procs_per_node}"
    out = output_dir(args.out, "network")
    busbw_rows: list[dict[str, Any]] = []
    train_rows: list[dict[str, Any]] = []
    for link in links:
        if args.busbw_bytes:
            busbw_rows += busbw(out / f"busbw-{link}", cluster, link, args.busbw_bytes, args.timeout_s)
        train_rows += training(out, cluster, link, labels, model, args.steps, args.timeout_s)
    if busbw_rows:
        show_table(f"poise bench network: all-reduce of {args.busbw_bytes}B on {cluster} (nodes:workers)", busbw_rows, [
            ("link", "link", str),
            ("op", "algorithm", str),
            ("time_s", "time", lambda v: f"{v * 1e3:.0f} ms"),
            ("busbw_gbit_per_s", "busbw", lambda v: f"{v:.3f} Gbit/s"),
            ("line_rate_ratio", "vs line rate", lambda v: f"{v:.2f}"),
            ("vs_flat", "vs flat", lambda v: f"{v:.2f}x"),
        ])
    show_table(f"poise bench network: training on {cluster} (nodes:workers), {args.steps} steps", train_rows, [
        ("link", "link", str),
        ("run", "run", str),
        ("median_step_s", "median step", lambda v: f"{v * 1e3:.0f} ms"),
        ("tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
        ("vs_ddp", "vs DDP", lambda v: f"{v:.2f}x"),
        ("vs_torch_powersgd", "vs torch PowerSGD", lambda v: f"{v:.2f}x"),
        ("wire_mb_per_step", "MB sent/step", lambda v: f"{v:.2f}"),
        ("inter_node_mb_per_step", "MB between nodes", lambda v: f"{v:.2f}" if v else "-"),
        ("comm_exposed_s", "comm exposed", lambda v: f"{v * 1e3:.0f} ms"),
        ("eval_loss", "eval loss", lambda v: f"{v:.4f}"),
        ("loss_vs_ddp_pct", "vs DDP", lambda v: f"{v:+.2f}%"),
    ])
    save_results(out, "network", {"cluster": cluster, "links": links, "steps": args.steps, "model_args": model,
                                  "busbw": busbw_rows, "training": train_rows})
    return 0


def busbw(out: Path, cluster: str, link: str, size: str, timeout_s: float) -> list[dict[str, Any]]:
    """``poise diagnose busbw`` of :data:`BUSBW_OPS` at one size on a fresh cluster: one row per op."""
    cmd = [sys.executable, "-m", "poise", "diagnose", "busbw", "--cluster", cluster, "--link", link,
           "--min-bytes", size, "--max-bytes", size, "--ops", ",".join(BUSBW_OPS), "--out", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "diagnose.log", "w") as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"busbw on {cluster} at {link} failed (exit {proc.returncode}, see {out / 'diagnose.log'})")
    data = json.loads((out / "busbw.json").read_text())
    line_rate_bytes_per_s = link_rate_bit_per_s(link) / 8
    rows = [{"link": link, "op": r["op"], "time_s": r["time_s"], "busbw_gbit_per_s": r["busbw_bytes_per_s"] * 8e-9,
             "line_rate_ratio": r["busbw_bytes_per_s"] / line_rate_bytes_per_s}
            for r in data["results"] if not r["error"]]
    flat = next((r["time_s"] for r in rows if r["op"] == "all_reduce"), None)
    for row in rows:
        row["vs_flat"] = flat / row["time_s"] if flat else None
    return rows


def training(out: Path, cluster: str, link: str, labels: list[str], model: list[str], steps: int,
             timeout_s: float) -> list[dict[str, Any]]:
    """One ``poise train --cluster`` job per run label at ``link``: one row each."""
    rows = []
    for label in labels:
        train_args = [*model, "--steps", str(steps), "--cluster", cluster, "--link", link, *RUNS[label]]
        report = run_train_job(f"{link}-{label}", out, train_args, timeout_s)
        rows.append({
            "link": link, "run": label, "median_step_s": report["median_step_s"],
            # real tokens per step over the median step: the steady rate, past the warm-up steps
            "tokens_per_s": report["loss_curve"][-1][0] / report["steps"] / report["median_step_s"],
            "wire_mb_per_step": report["comm_wire_bytes_per_step"] / 1e6,
            # all node leaders together, between nodes (hierarchical runs with a codec; else 0)
            "inter_node_mb_per_step": report["comm_inter_node_wire_bytes_per_step"] / 1e6,
            "comm_exposed_s": report["comm_exposed_s_per_step"], "comm_overlap": report["comm_overlap"],
            "eval_loss": report["eval_loss"], "eval_accuracy": report["eval_accuracy"],
        })
    by_label = {r["run"]: r for r in rows}
    for row in rows:
        for ref, key in (("ddp", "vs_ddp"), ("torch-powersgd", "vs_torch_powersgd")):
            if ref in by_label:
                row[key] = by_label[ref]["median_step_s"] / row["median_step_s"]
        if "ddp" in by_label:
            row["loss_vs_ddp_pct"] = 100 * (row["eval_loss"] / by_label["ddp"]["eval_loss"] - 1)
    return rows
