"""``poise bench parallel``: DDP, FSDP2, HSDP, HSDP with a codec between nodes and data × pipeline
parallelism, side by side at equal loss, with each rank's memory.

On an emulated cluster of ``--nodes`` × ``--procs-per-node`` workers (default 2 × 2; network
namespaces behind tbf-shaped links at ``--link``, ``poise cluster``: root), code-lm (d_model 512,
6 layers, 16 sequences of 32 bytes per rank per step, :mod:`poise.bench.outer`'s realistic batch)
is trained by each run of ``--runs``:

- ``ddp``: plain DDP (the reference; its final eval loss after ``--steps`` is every run's target);
- ``fsdp``: FSDP2 over all workers (``--parallel fsdp``: each block and the root sharded);
- ``hsdp``: FSDP2's own HSDP, sharded inside a node and replicated across nodes;
- ``hsdp-int8``, ``hsdp-powersgd``: HSDP with poise's codec on the all-reduce between the nodes
  (int8 with error feedback; PowerSGD rank 4 from step 5), the reduce-scatter inside a node exact;
- ``fsdp-half-speed``: FSDP2 with worker 1 at half speed and poise's speed-aware balancing
  (``--balance dynamic`` at its default settings; whole-run balance is the figure);
- ``dp-pp``: ``poise pipeline`` with one stage per worker of a node and one replica per node
  (DDP over the replicas, between the nodes), each replica's batch as large as the others' whole
  node's, so that every run trains the same samples per step.

Per run: training seconds to the target (evaluations left out; linear between evaluations; "not
reached"), speed-up against ``ddp``, final eval loss, each worker's peak resident memory (MB,
the process's high-water mark: Python and torch included), the model + gradient + optimizer
state each worker holds (MB: what sharding divides), bytes over the node link per step (median
step), and whole-run balance. One row per run in ``parallel.json``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.bench.network import time_to_target
from poise.bench.outer import realistic

HELP = "DDP, FSDP2, HSDP, HSDP with an inter-node codec, DP x PP: time to DDP's loss, memory per rank, node-link bytes"

# (label, command, flags): the reference first
RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ddp": ("train", ("--parallel", "ddp", "--codec", "none")),  # plain DDP: exact, whatever poise would decide
    "fsdp": ("train", ("--parallel", "fsdp")),
    "hsdp": ("train", ("--parallel", "hsdp")),
    "hsdp-int8": ("train", ("--parallel", "hsdp", "--codec", "int8", "--comm.start_step", "5")),
    "hsdp-powersgd": ("train", ("--parallel", "hsdp", "--codec", "powersgd", "--comm.start_step", "5")),
    "fsdp-half-speed": ("train", ("--parallel", "fsdp", "--rank-speed", "1:0.5", "--balance", "dynamic")),
    "dp-pp": ("pipeline", ()),
}
DEFAULT_RUNS = tuple(RUNS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", default="1gbit", help="rate of every node's link (e.g. 1gbit, 100mbit)")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    parser.add_argument("--procs-per-node", type=int, default=2, help="workers per node")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"runs, comma-separated: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=60, help="steps of the reference run (ddp)")
    parser.add_argument("--extra-steps", type=float, default=0.5,
                        help="the other runs may take this share more steps to reach the reference's loss")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (time to accuracy)")
    parser.add_argument("--target", type=float, default=None,
                        help="target eval loss (default: ddp's final eval loss; given, ddp may be left out)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every run")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-parallel-<timestamp>)")
    parser.add_argument("train_args", nargs="*",
                        help=f"model flags after --, replacing the default ({' '.join(realistic())})")


def parse(args: argparse.Namespace) -> list[str]:
    """The run labels in run order (``ddp`` first), or a one-line ValueError for the first bad flag."""
    require_positive(args, "nodes", "procs_per_node", "steps", "eval_every", "timeout_s")
    if not (math.isfinite(args.extra_steps) and 0 <= args.extra_steps <= 10):
        raise ValueError(f"--extra-steps={args.extra_steps} must be in 0..10 (a share of --steps)")
    if args.seed < 0:
        raise ValueError(f"--seed={args.seed} must be >= 0")
    labels = [x.strip() for x in args.runs.split(",") if x.strip()]
    unknown = [x for x in labels if x not in RUNS]
    if not labels or unknown or len(set(labels)) != len(labels):
        raise ValueError(f"--runs={args.runs!r}: give distinct runs among {', '.join(RUNS)}")
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        raise ValueError(f"--target={args.target} must be a positive eval loss")
    if "ddp" not in labels and args.target is None:
        raise ValueError(f"--runs={args.runs!r} must include ddp: its final eval loss is every run's target")
    if "dp-pp" in labels and args.procs_per_node < 2:
        raise ValueError(f"dp-pp needs at least 2 workers per node (one stage each), not --procs-per-node "
                         f"{args.procs_per_node}")
    return sorted(labels, key=lambda x: x != "ddp")


def job(label: str, args: argparse.Namespace, model: Sequence[str], target: float | None) -> tuple[str, list[str]]:
    """``(command, flags)`` of one run (without ``--out``)."""
    command, extra = RUNS[label]
    steps = args.steps if label == "ddp" else math.ceil(args.steps * (1 + args.extra_steps))
    flags = [*model, "--steps", str(steps), "--seed", str(args.seed), "--cluster",
             f"{args.nodes}:{args.procs_per_node}", "--link", args.link, "--train.eval_every", str(args.eval_every)]
    if command == "pipeline":  # a stage per worker of a node, a replica per node
        flags = [f for f in flags if f not in ("--task", "code-lm")]  # the pipeline trains code-lm only
        if "--batch-size" in flags:  # per replica: a step trains as many samples as the others' steps
            at = flags.index("--batch-size") + 1
            flags[at] = str(int(flags[at]) * args.procs_per_node)
        flags += ["--stages", str(args.procs_per_node), "--dp", str(args.nodes)]
    flags += extra
    if label != "ddp":  # the reference's schedule; stop once its loss is reached
        flags += ["--train.schedule_steps", str(args.steps)]
        if target is not None:
            flags += ["--train.stop_at_eval_loss", repr(target)]
    return command, flags


def measure(report: dict[str, Any], target: float | None) -> dict[str, Any]:
    """A run's figures from its ``report.json`` (see module doc)."""
    curve = report.get("eval_curve") or []
    memory = report.get("memory") or []
    return {
        "steps": int(report["steps"]),
        "time_to_target_s": time_to_target(curve, target) if target is not None and curve else None,
        "target_eval_loss": target,
        "final_eval_loss": float(report["eval_loss"]) if report.get("eval_loss") is not None else None,
        "peak_rss_mb_per_rank": [m.get("peak_resident_mb") for m in memory],
        "state_mb_per_rank": [m.get("model_state_mb") for m in memory],
        "bytes_per_step_inter_node": report.get("comm_inter_node_wire_bytes_per_step"),
        "balance": report.get("balance"),
        "median_step_s": report.get("median_step_s"),
    }


def run(args: argparse.Namespace) -> int:
    labels = parse(args)
    model = list(args.train_args) or realistic()
    out = output_dir(args.out, "parallel")
    target = args.target
    rows: list[dict[str, Any]] = []
    for label in labels:
        command, flags = job(label, args, model, target)
        report = run_train_job(label, out, flags, args.timeout_s, command=command)
        if label == "ddp" and target is None:
            target = float(report["eval_loss"])
        rows.append({"run": label, "command": f"poise {command} {' '.join(flags)}", **measure(report, target)})
    summarize(rows)
    show(rows, args, target)
    save_results(out, "parallel", {"link": args.link, "cluster": f"{args.nodes}:{args.procs_per_node}",
                                   "seed": args.seed, "steps": args.steps, "target_eval_loss": target,
                                   "model_args": model, "rows": rows})
    return 0


def summarize(rows: list[dict[str, Any]]) -> None:
    """Add ``speedup_vs_ddp`` (ddp's time to the target over the run's), ``state_vs_ddp`` (the
    run's largest per-rank model + optimizer state over ddp's) and ``rss_vs_ddp`` (peak resident
    memory, the same way) to every row."""
    ddp = next((r for r in rows if r["run"] == "ddp"), None)

    def worst(values: Sequence[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return max(known) if known else None

    for row in rows:
        base, own = (ddp or {}).get("time_to_target_s"), row["time_to_target_s"]
        row["speedup_vs_ddp"] = base / own if base and own else None
        for key, name in (("state_mb_per_rank", "state_vs_ddp"), ("peak_rss_mb_per_rank", "rss_vs_ddp")):
            mine, theirs = worst(row[key]), worst((ddp or {}).get(key) or [])
            row[name] = mine / theirs if mine and theirs else None


def _mb(values: Sequence[float | None]) -> str:
    return " ".join("-" if v is None else f"{v:,.0f}" for v in values)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def show(rows: Sequence[dict[str, Any]], args: argparse.Namespace, target: float | None) -> None:
    """The rich table of the rows."""
    show_table(f"poise bench parallel: time to ddp's eval loss after {args.steps} steps "
               f"({'none' if target is None else f'{target:.4f}'}) on {args.nodes}:{args.procs_per_node} "
               f"(nodes:workers) at {args.link}, seed {args.seed}", rows, [
                   ("run", "run", str),
                   ("steps", "steps run", str),
                   ("time_to_target_s", "time to target", lambda v: "not reached" if v is None else f"{v:.1f} s"),
                   ("speedup_vs_ddp", "vs DDP", _x),
                   ("final_eval_loss", "final eval loss", lambda v: "-" if v is None else f"{v:.4f}"),
                   ("state_mb_per_rank", "model+optimizer MB per rank", _mb),
                   ("state_vs_ddp", "vs DDP", _x),
                   ("peak_rss_mb_per_rank", "peak RSS MB per rank", _mb),
                   ("bytes_per_step_inter_node", "node-link bytes/step",
                    lambda v: "-" if v is None else f"{v:,.0f}"),
                   ("balance", "balance", lambda v: "-" if v is None else f"{v:.3f}"),
               ])

