"""``poise bench partition``: exact vs uniform vs parameters vs greedy stage plans, and a real pipeline.

Three parts in one invocation:

1. **code-lm**: the byte transformer's layers (embedding, every block, output head with the
   loss) profiled on a real micro-batch; for each stage count, each method's plan, predicted
   stage seconds, bottleneck and balance, checked against brute force.
2. **random**: ``--cases`` seeded cost vectors (4–16 layers, 2–6 stages) in three families:
   ``uniform`` (costs U(0.5, 1.5)), ``lognormal`` (σ = 0.8) and ``heavy-ends`` (first and last
   layer 2–6× a middle one, like a large-vocabulary embedding and head). The ``parameters``
   method sees parameter counts that track time only roughly (cost × lognormal noise, σ = 0.5).
   Every case is brute-forced: does exact reach the optimal bottleneck, how far are the
   baselines from it, and how often is balance ≥ 0.9 where some plan reaches it.
3. **running**: real ``poise pipeline`` jobs (``--run-stages`` workers on gloo) for
   ``--run-methods``: measured balance of the stages' compute next to the predicted one.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from poise import config as cfg
from poise.balance.metrics import balance
from poise.balance.partition import all_plans, describe_plan, partition, stage_times
from poise.bench.harness import output_dir, positive_ints, require_positive, run_train_job, save_results, show_table

HELP = "stage plans: exact vs uniform/parameters/greedy on code-lm and random costs, plus a real pipeline"
METHOD_ORDER = ("exact", "uniform", "parameters", "greedy")
BRUTE_FORCE_LIMIT = 50_000  # plans enumerated at most per case


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", default="2,3,4", help="code-lm: stage counts to plan for")
    parser.add_argument("--layers", type=int, default=6, help="code-lm: transformer blocks")
    parser.add_argument("--d-model", type=int, default=128, help="code-lm: width")
    parser.add_argument("--max-seq-len", type=int, default=256, help="code-lm: bytes per sample (batches padded to it)")
    parser.add_argument("--batch-size", type=int, default=8, help="code-lm: samples per step")
    parser.add_argument("--micro-batches", type=int, default=4, help="code-lm: micro-batches per step")
    parser.add_argument("--link-bandwidth", type=float, default=0.0,
                        help="code-lm: bytes/s between stages for the comm cost (0 = not modelled)")
    parser.add_argument("--repeats", type=int, default=7, help="code-lm: timed runs per layer (median)")
    parser.add_argument("--cache-dir", default="", help="code-lm corpus cache ('' = ~/.cache/poise)")
    parser.add_argument("--cases", type=int, default=200, help="random cost vectors")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cost vectors and the data")
    parser.add_argument("--run-stages", type=int, default=3, help="running pipeline: stages (workers)")
    parser.add_argument("--run-methods", default="exact,uniform", help="running pipeline: methods to run (none: '')")
    parser.add_argument("--run-steps", type=int, default=12, help="running pipeline: steps per run")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per pipeline run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-partition-<timestamp>)")
    parser.add_argument("pipeline_args", nargs="*", help="extra 'poise pipeline' flags for every run, after --")


# ----------------------------------------------------------------------------- evaluation


def brute_force(
    costs: Sequence[float], num_stages: int, comm: Sequence[float] | None = None
) -> dict[str, float] | None:
    """Optimal bottleneck and best balance over every plan (None when there are too many plans)."""
    if math.comb(len(costs) - 1, num_stages - 1) > BRUTE_FORCE_LIMIT:
        return None
    times = [stage_times(costs, plan, boundary_costs=comm) for plan in all_plans(len(costs), num_stages)]
    best = min(max(t) for t in times)
    return {
        "bottleneck_s": best,
        "best_balance_any_plan": max(balance(t) for t in times),
    }


def compare_methods(costs: Sequence[float], num_stages: int, weights: Sequence[float],
                    comm: Sequence[float] | None = None) -> dict[str, Any]:
    """Every method's plan on one case, with the brute-force optimum when it is small enough."""
    plans = {
        "exact": partition(costs, num_stages, boundary_costs=comm),
        "uniform": partition(costs, num_stages, method="uniform"),
        "parameters": partition(costs, num_stages, method="parameters", weights=weights),
        "greedy": partition(costs, num_stages, method="greedy"),
    }
    methods = {}
    for name, plan in plans.items():
        summary = describe_plan(costs, plan, boundary_costs=comm)
        methods[name] = {"boundaries": plan, "stage_s": summary.stage_s, "bottleneck_s": summary.bottleneck_s,
                         "balance": summary.balance}
    reference = brute_force(costs, num_stages, comm)
    exact = methods["exact"]["bottleneck_s"]
    for m in methods.values():
        m["vs_exact"] = m["bottleneck_s"] / exact
        if reference is not None:
            m["vs_optimal"] = m["bottleneck_s"] / reference["bottleneck_s"]
    return {"methods": methods, "brute_force": reference}


def random_cases(num_cases: int, seed: int) -> list[dict[str, Any]]:
    """Seeded cost vectors in three families, with noisy parameter counts for the 'parameters' method."""
    rng = np.random.default_rng(seed)
    families = ("uniform", "lognormal", "heavy-ends")
    cases = []
    for index in range(num_cases):
        family = families[index % len(families)]
        n = int(rng.integers(4, 17))
        p = int(rng.integers(2, min(6, n) + 1))
        if family == "uniform":
            costs = rng.uniform(0.5, 1.5, n)
        elif family == "lognormal":
            costs = rng.lognormal(0.0, 0.8, n)
        else:
            costs = rng.uniform(0.8, 1.2, n)
            costs[0] *= rng.uniform(2.0, 6.0)
            costs[-1] *= rng.uniform(2.0, 6.0)
        weights = costs * rng.lognormal(0.0, 0.5, n)
        cases.append({"family": family, "num_stages": p, "costs": costs.tolist(), "weights": weights.tolist()})
    return cases


def summarize_random(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: optimal cases, bottleneck vs the optimum, balance."""
    rows = []
    can_reach = [r for r in results if r["brute_force"]["best_balance_any_plan"] >= 0.9]
    for name in METHOD_ORDER:
        ms = [r["methods"][name] for r in results]
        ratios = [m["vs_optimal"] for m in ms]
        balances = [m["balance"] for m in ms]
        rows.append({
            "method": name,
            "cases": len(ms),
            "optimal": sum(1 for x in ratios if x <= 1 + 1e-9),
            "vs_optimal_median": statistics.median(ratios),
            "vs_optimal_worst": max(ratios),
            "balance_median": statistics.median(balances),
            "balance_ge_0.9": sum(1 for b in balances if b >= 0.9),
            "balance_ge_0.9_where_possible": sum(1 for r in can_reach if r["methods"][name]["balance"] >= 0.9),
            "cases_where_possible": len(can_reach),
        })
    return rows


# ----------------------------------------------------------------------------- parts


def _code_lm_profile(args: argparse.Namespace) -> tuple[Any, int]:
    import torch

    from poise.pipeline.worker import FixedLengthBatches, first_micro_batch, layer_names, profile_micro_batch
    from poise.tasks.registry import build_task

    config = cfg.from_dict({
        "task": {"name": "code-lm", "max_seq_len": args.max_seq_len, "d_model": args.d_model,
                 "num_layers": args.layers, "cache_dir": args.cache_dir},
        "train": {"batch_size": args.batch_size, "seed": args.seed},
    })
    task = build_task(config)
    layers = task.build_model().pipeline_layers()  # type: ignore[operator]
    batches = FixedLengthBatches(task, args.batch_size, args.max_seq_len - 1, args.seed)
    micro = first_micro_batch(batches, args.micro_batches)
    # The threads a pipeline worker gets on this machine with --run-stages workers.
    threads = max(1, (os.cpu_count() or 1) // max(1, args.run_stages))
    torch.set_num_threads(threads)
    profile = profile_micro_batch(layers, layer_names(args.layers), micro, repeats=args.repeats, warmup=2)
    return profile, threads


def code_lm_part(args: argparse.Namespace, stage_counts: list[int]) -> dict[str, Any]:
    profile, threads = _code_lm_profile(args)
    costs = [t * args.micro_batches for t in profile.time_s]  # seconds per step
    comm = None
    if args.link_bandwidth > 0:
        comm = [s * args.micro_batches for s in profile.boundary_costs_s(args.link_bandwidth)]
    per_p = {p: compare_methods(costs, p, profile.param_bytes, comm) for p in stage_counts if p <= len(costs)}
    rows = []
    for p, result in per_p.items():
        for name in METHOD_ORDER:
            m = result["methods"][name]
            rows.append({"stages": p, "method": name, **m,
                         "plan": " | ".join("+".join(profile.names[a:b]) for a, b in pairwise(m["boundaries"]))})
    show_table(
        f"code-lm ({args.layers} blocks, d={args.d_model}, {args.max_seq_len} bytes, micro-batch "
        f"{math.ceil(args.batch_size / args.micro_batches)} x {args.micro_batches}, {threads} thread(s)): "
        f"layer ms " + ", ".join(f"{n} {t * 1e3:.1f}" for n, t in zip(profile.names, profile.time_s, strict=True)),
        rows,
        [("stages", "stages", str), ("method", "method", str), ("plan", "plan", str),
         ("bottleneck_s", "bottleneck s/step", lambda v: f"{v:.4f}"),
         ("vs_optimal", "vs optimal", lambda v: f"{v:.3f}"),
         ("balance", "balance", lambda v: f"{v:.3f}")],
    )
    return {"profile": profile.as_dict(), "threads": threads, "costs_s_per_step": costs, "comm_s_per_step": comm,
            "rows": rows, "brute_force": {p: r["brute_force"] for p, r in per_p.items()}}


def random_part(args: argparse.Namespace) -> dict[str, Any]:
    cases = random_cases(args.cases, args.seed)
    results = [
        {**case, **compare_methods(case["costs"], case["num_stages"], case["weights"])} for case in cases
    ]
    summary = summarize_random(results)
    possible = summary[0]["cases_where_possible"]
    show_table(
        f"{args.cases} random cost vectors (seed {args.seed}; 4-16 layers, 2-6 stages; every case brute-forced)",
        summary,
        [("method", "method", str), ("optimal", "optimal bottleneck", lambda v: f"{v}/{args.cases}"),
         ("vs_optimal_median", "bottleneck / optimal (median)", lambda v: f"{v:.3f}"),
         ("vs_optimal_worst", "(worst)", lambda v: f"{v:.3f}"),
         ("balance_median", "balance (median)", lambda v: f"{v:.3f}"),
         ("balance_ge_0.9", "balance >= 0.9", lambda v: f"{v}/{args.cases}"),
         ("balance_ge_0.9_where_possible", "where some plan >= 0.9", lambda v: f"{v}/{possible}")],
    )
    return {"summary": summary, "cases": results}


def running_part(args: argparse.Namespace, out: Any, methods: list[str]) -> list[dict[str, Any]]:
    rows = []
    for method in methods:
        flags = ["--stages", str(args.run_stages), "--partition", method, "--steps", str(args.run_steps),
                 "--task.num_layers", str(args.layers), "--task.d_model", str(args.d_model),
                 "--max-seq-len", str(args.max_seq_len), "--batch-size", str(args.batch_size),
                 "--micro-batches", str(args.micro_batches), "--seed", str(args.seed),
                 "--pipeline.profile_repeats", str(args.repeats), *args.pipeline_args]
        if args.cache_dir:
            flags += ["--task.cache_dir", args.cache_dir]
        report = run_train_job(f"run-{method}", out, flags, args.timeout_s, command="pipeline")
        plan = report["plan"]
        rows.append({
            "method": method,
            "plan": " | ".join("+".join(s) for s in plan["stage_layers"]),
            "predicted_stage_s": report["predicted_stage_s"],
            "measured_stage_s": report["measured_stage_s"],
            "predicted_balance": report["predicted_balance"],
            "measured_balance": report["measured_balance"],
            "balance_gap": report["balance_gap"],
            "step_s": report["step_s"],
            "throughput_tokens_per_s": report["throughput_tokens_per_s"],
            "flags": flags,
        })
    show_table(
        f"running pipeline: code-lm on {args.run_stages} gloo workers, {args.run_steps} steps "
        f"(medians after warm-up)",
        rows,
        [("method", "method", str), ("plan", "plan", str),
         ("predicted_balance", "predicted balance", lambda v: f"{v:.3f}"),
         ("measured_balance", "measured balance", lambda v: f"{v:.3f}"),
         ("balance_gap", "gap", lambda v: f"{v:.3f}"),
         ("step_s", "step s", lambda v: f"{v:.3f}"),
         ("throughput_tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}")],
    )
    return rows


def run(args: argparse.Namespace) -> int:
    require_positive(args, "layers", "d_model", "batch_size", "micro_batches", "repeats", "run_stages", "timeout_s")
    if args.cases < 0 or args.run_steps < 0 or args.link_bandwidth < 0:
        raise ValueError(f"--cases={args.cases}, --run-steps={args.run_steps} and "
                         f"--link-bandwidth={args.link_bandwidth} must be >= 0")
    stage_counts = positive_ints(args.stages, "--stages")
    methods = [m for m in args.run_methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_ORDER]
    if unknown:
        raise ValueError(f"--run-methods has unknown {unknown}: allowed are {', '.join(METHOD_ORDER)}")
    out = output_dir(args.out, "partition")
    results: dict[str, Any] = {"code_lm": code_lm_part(args, stage_counts)}
    if args.cases:
        results["random"] = random_part(args)
    if methods and args.run_steps:
        results["running"] = running_part(args, out, methods)
    save_results(out, "partition", {"args": {k: v for k, v in vars(args).items() if k != "run"}, **results})
    return 0
