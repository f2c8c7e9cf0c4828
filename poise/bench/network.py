"""``poise bench network``: collectives and gradient codecs over real, rate-shaped links, at equal accuracy.

For each link rate (1 Gbit/s, 10 Gbit/s and 100 Mbit/s by default) an emulated cluster of
``--nodes`` nodes × ``--procs-per-node`` workers (network namespaces behind tbf-shaped links,
``poise cluster``) runs, side by side:

1. ``poise diagnose busbw`` of flat (gloo's own), ring and hierarchical all-reduce at one size
   (64 MB): time, busbw with the nccl-tests convention and its ratio to the line rate. busbw
   assumes every rank's data crosses the network (2(n-1)/n of it per rank), so an algorithm
   that sends less over the slow links (hierarchical: one copy per node) can show a busbw above
   the line rate: the ratio then says how much faster than a flat ring at full line rate it is.
2. The same training job (code-lm widened to ~19M parameters by default, few tokens per step
   so that communication, not the 2 shared cores, sets the pace) with plain DDP, torch's
   PowerSGD hook and poise's codecs, compared at equal accuracy: plain DDP runs ``--steps``
   steps and its final eval loss is the target; every other run may take ``--extra-steps``
   more, evaluates every ``--eval-every`` steps and stops once it reaches the target. A lossy
   run's learning-rate schedule spans its extra steps; one whose gradients go exact keeps
   DDP's (``--train.schedule_steps``), so ``auto`` that drops PowerSGD over a fast link is
   plain DDP itself, not DDP with a longer schedule. Reported per run: the training seconds to the target
   (evaluations left out; "not reached" if it never gets there), the speed-up on that measure
   against DDP and against torch's PowerSGD, the median step and its ratio to DDP's, the
   final eval loss, bytes per step and the communication left exposed after backward.

Why equal accuracy: a lossy codec's steps are cheaper but each is worth less; quoted at a fixed
step count, sign compression is 2.3x faster than DDP per step, and yet DDP reaches a better
model in the same wall time. Plain DDP at 100 Mbit/s needs several seconds a step, so at the
``--short-links`` the baselines run a few steps and their time to the target is extrapolated
(their median step times the steps they needed at a full link), and say so.

The cluster needs root (``ip``, ``tc``); each job brings its own cluster up and down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.log import make_console
from poise.units import link_rate_bit_per_s

HELP = "flat/ring/hierarchical busbw, and each codec's time to plain DDP's loss over shaped links (emulated cluster)"

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
    "powersgd-early": ("--codec", "powersgd", "--comm.start_step", "5"),
    "powersgd-r4": ("--codec", "powersgd", "--comm.powersgd_rank", "4", "--comm.start_step", "5"),
    "auto": ("--codec", "auto", "--comm.start_step", "5"),  # PowerSGD on trial, kept only where it pays
}
DEFAULT_RUNS = ("ddp", "torch-powersgd", "powersgd-early", "auto")
BUSBW_OPS = ("all_reduce", "poise-ring", "poise-hierarchical")
MODEL_ARGS = ("--task", "code-lm", "--task.d_model", "512", "--task.num_layers", "6", "--task.num_heads", "8",
              "--max-seq-len", "32", "--batch-size", "1", "--task.eval_max_samples", "128")


@dataclass(frozen=True)
class Plan:
    """How long the training runs go (see :func:`training`): steps of the reference, the
    share of extra steps the others get to reach its loss (``extra``), evaluations every
    ``eval_every`` steps, the links where the baselines run ``short_steps`` only, a target
    loss given outright (None: the reference's), and each job's limit in seconds."""

    steps: int
    extra: float
    eval_every: int
    short_links: tuple[str, ...]
    short_steps: int
    target: float | None
    timeout_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--links", default="1gbit,10gbit,100mbit", help="link rates, comma-separated")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    parser.add_argument("--procs-per-node", type=int, default=2, help="workers per node")
    parser.add_argument("--busbw-bytes", default="64M", help="all-reduce size of the busbw part ('' skips it)")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"training runs: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=200, help="steps of the reference run (ddp)")
    parser.add_argument("--extra-steps", type=float, default=0.25,
                        help="the other runs may take this share more steps to reach the reference's loss")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (time to accuracy)")
    parser.add_argument("--short-links", default="100mbit",
                        help="links where ddp and torch's hooks run --short-steps only, their time to the target "
                             "extrapolated from a link where they ran in full ('' = none)")
    parser.add_argument("--short-steps", type=int, default=20, help="steps of the short baseline runs")
    parser.add_argument("--target", type=float, default=None,
                        help="target eval loss (default: the first full ddp run's final eval loss)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-network-<timestamp>)")
    parser.add_argument("train_args", nargs="*",
                        help="'poise train' flags after --, replacing the default model "
                             f"({' '.join(MODEL_ARGS)})")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "nodes", "procs_per_node", "steps", "eval_every", "short_steps", "timeout_s")
    if args.extra_steps < 0:
        raise ValueError(f"--extra-steps={args.extra_steps} must be >= 0")
    links = [t.strip() for t in args.links.split(",") if t.strip()]
    short_links = tuple(t.strip() for t in args.short_links.split(",") if t.strip())
    for link in (*links, *short_links):
        link_rate_bit_per_s(link)  # one-line error for a bad rate, before anything starts
    labels = [t.strip() for t in args.runs.split(",") if t.strip()]
    unknown = [x for x in labels if x not in RUNS]
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(unknown)}; allowed are {', '.join(RUNS)}")
    if short_links and "ddp" in labels and all(link in short_links for link in links) and args.target is None:
        raise ValueError(f"--short-links={args.short_links!r} covers every link: ddp must run in full at one "
                         "link to set the target (or give --target)")
    # the full links first: the short ones extrapolate from them
    links.sort(key=lambda link: link in short_links)
    plan = Plan(args.steps, args.extra_steps, args.eval_every, short_links, args.short_steps, args.target,
                args.timeout_s)
    model = list(args.train_args) or list(MODEL_ARGS)
    cluster = f"{args.nodes}:{args.procs_per_node}"
    out = output_dir(args.out, "network")
    busbw_rows: list[dict[str, Any]] = []
    train_rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}
    for link in links:
        if args.busbw_bytes:
            busbw_rows += busbw(out / f"busbw-{link}", cluster, link, args.busbw_bytes, args.timeout_s)
        train_rows += training(out, cluster, link, labels, model, plan, reference)
    if busbw_rows:
        show_table(f"poise bench network: all-reduce of {args.busbw_bytes}B on {cluster} (nodes:workers)", busbw_rows, [
            ("link", "link", str),
            ("op", "algorithm", str),
            ("time_s", "time", lambda v: f"{v * 1e3:.0f} ms"),
            ("busbw_gbit_per_s", "busbw", lambda v: f"{v:.3f} Gbit/s"),
            ("line_rate_ratio", "vs line rate", lambda v: f"{v:.2f}"),
            ("vs_flat", "vs flat", lambda v: f"{v:.2f}x"),
        ])
    target = reference.get("target")
    show_table(f"poise bench network: time to ddp's eval loss after {args.steps} steps "
               f"({f'{target:.4f}' if target else 'none'}) on {cluster} (nodes:workers)", train_rows, [
        ("link", "link", str),
        ("run", "run", str),
        ("steps", "steps run", str),
        ("median_step_s", "median step", lambda v: f"{v * 1e3:.0f} ms"),
        ("vs_ddp", "step vs DDP", lambda v: f"{v:.2f}x"),
        ("time_to_target_s", "time to target", _seconds),
        ("extrapolated", "how", lambda v: "extrapolated" if v else "measured"),
        ("speedup_vs_ddp", "vs DDP", lambda v: f"{v:.2f}x"),
        ("speedup_vs_torch_powersgd", "vs torch PowerSGD", lambda v: f"{v:.2f}x"),
        ("final_eval_loss", "final eval loss", lambda v: f"{v:.4f}"),
        ("wire_mb_per_step", "MB sent/step", lambda v: f"{v:.2f}"),
        ("comm_exposed_s", "comm exposed", lambda v: f"{v * 1e3:.0f} ms"),
    ])
    if any(r["extrapolated"] for r in train_rows):
        make_console().print("extrapolated: the steps the run needed at a link where it ran in full, its "
                             "warm-up steps at ddp's median step here and the others at its own")
    save_results(out, "network", {"cluster": cluster, "links": links, "plan": dataclasses.asdict(plan),
                                  "target_eval_loss": target, "model_args": model,
                                  "busbw": busbw_rows, "training": train_rows})
    return 0


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


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


def time_to_target(curve: Sequence[dict[str, float]], target: float) -> float | None:
    """Training seconds until the eval loss first reaches ``target``: linear between the last
    evaluation above it and the first at or below it (from 0 s if the first one already is);
    None when no evaluation of ``curve`` (``report["eval_curve"]``) reaches it."""
    previous = None
    for point in curve:
        if point["loss"] <= target:
            if previous is None or previous["loss"] <= point["loss"]:
                return point["train_s"]
            share = (previous["loss"] - target) / (previous["loss"] - point["loss"])
            return previous["train_s"] + share * (point["train_s"] - previous["train_s"])
        previous = point
    return None


def steps_to_target(curve: Sequence[dict[str, float]], target: float) -> float | None:
    """Optimizer steps until the eval loss first reaches ``target`` (interpolated as
    :func:`time_to_target`), or None."""
    return time_to_target([{"loss": p["loss"], "train_s": p["step"]} for p in curve], target)


def training(out: Path, cluster: str, link: str, labels: list[str], model: list[str], plan: Plan,
             reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The training runs at ``link``, time to accuracy: one row per run label.

    ``ddp`` runs first (if asked for) for ``plan.steps`` steps, evaluating every
    ``plan.eval_every``; the first such run's final eval loss is the target of every link
    (``reference["target"]``, unless ``plan.target`` sets it). Every other run gets
    ``plan.extra`` more steps to reach it and stops when it does. At the links of
    ``plan.short_links``, ``ddp`` and torch's hooks run ``plan.short_steps`` steps only: their
    time to the target is then their median step times the steps they needed at a link where
    they ran in full (``reference["steps"]``, filled here), marked ``extrapolated``.
    """
    rows: list[dict[str, Any]] = []
    reference.setdefault("target", plan.target)
    reference.setdefault("steps", {})
    reference.setdefault("starts", {})
    for label in labels:
        short = link in plan.short_links and (label == "ddp" or label.startswith("torch-"))
        steps = (plan.short_steps if short else plan.steps if label == "ddp"
                 else math.ceil(plan.steps * (1 + plan.extra)))
        flags = [*model, "--steps", str(steps), "--cluster", cluster, "--link", link, *RUNS[label]]
        if not short:
            flags += ["--train.eval_every", str(plan.eval_every)]
            if label != "ddp":  # exact steps keep the reference's schedule, lossy ones span the extra steps
                flags += ["--train.schedule_steps", str(plan.steps)]
                if reference["target"] is not None:
                    flags += ["--train.stop_at_eval_loss", repr(reference["target"])]
        report = run_train_job(f"{link}-{label}", out, flags, plan.timeout_s)
        curve = report["eval_curve"]
        if label == "ddp" and not short and reference["target"] is None:
            reference["target"] = report["eval_loss"]
        target = reference["target"]
        row = _row(link, label, report)
        if short:
            needed = reference["steps"].get(label)
            row["extrapolated"] = True
            # its uncompressed warm-up steps at ddp's median step at this link, the rest at its own
            warmup = min(reference["starts"].get(label, 0), needed or 0)  # as many as where it ran in full
            ddp_here = _find(rows, "ddp")
            uncompressed_s = ddp_here["median_step_s"] if ddp_here else None
            row["time_to_target_s"] = (None if needed is None else
                                       needed * report["median_step_s"] if uncompressed_s is None or label == "ddp"
                                       else warmup * uncompressed_s + (needed - warmup) * report["median_step_s"])
        else:
            row["extrapolated"] = False
            row["time_to_target_s"] = time_to_target(curve, target) if target is not None else None
            reached = steps_to_target(curve, target) if target is not None else None
            if reached is not None:
                reference["steps"].setdefault(label, reached)
                reference["starts"].setdefault(label, report["compression_start_step"])
        row["target_eval_loss"] = target
        rows.append(row)
    by_label = {r["run"]: r for r in rows}
    for row in rows:
        for ref, key, step_key in (("ddp", "speedup_vs_ddp", "vs_ddp"),
                                   ("torch-powersgd", "speedup_vs_torch_powersgd", "vs_torch_powersgd")):
            base = by_label.get(ref)
            if base is None:
                continue
            row[step_key] = base["median_step_s"] / row["median_step_s"]
            if base["time_to_target_s"] and row["time_to_target_s"]:
                row[key] = base["time_to_target_s"] / row["time_to_target_s"]
        if reference["target"]:
            row["loss_vs_target_pct"] = 100 * (row["final_eval_loss"] / reference["target"] - 1)
    return rows


def _find(rows: list[dict[str, Any]], label: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["run"] == label), None)


def _row(link: str, label: str, report: dict[str, Any]) -> dict[str, Any]:
    return {
        "link": link, "run": label, "steps": report["steps"], "median_step_s": report["median_step_s"],
        "compression_start_step": report["compression_start_step"],
        # real tokens per step over the median step: the steady rate, past the warm-up steps
        "tokens_per_s": report["loss_curve"][-1][0] / report["steps"] / report["median_step_s"],
        "wire_mb_per_step": report["comm_wire_bytes_per_step"] / 1e6,
        # all ranks together, bytes given to collectives that span nodes (hierarchical: the leaders')
        "inter_node_mb_per_step": report["comm_inter_node_wire_bytes_per_step"] / 1e6,
        "comm_exposed_s": report["comm_exposed_s_per_step"], "comm_overlap": report["comm_overlap"],
        "final_eval_loss": report["eval_loss"], "eval_accuracy": report["eval_accuracy"],
        "stopped_at_target": report["stopped_at_eval_loss"], "eval_curve": report["eval_curve"],
    }
