"""``poise bench packed``: packed sequences, the naive packer against poise's, with equal ranks and a half-speed rank.

Real ``poise train`` jobs of code-lm in packed mode (``--task.packed true``): whole documents
of the standard library's source (definitions: a long tail, a fifth of them longer than
2,048 bytes) packed into rows of ``--row-tokens`` bytes, attention per document, ``--rows``
rows per rank per step, on ``--nproc`` workers (2 by default; 4 as an option):

(a) naive: rows filled in order, an equal run of them per rank (``--balance static``), equal speeds;
(b) poise: each step's pieces split by cost ``a·L + b·L²`` and speed (``--balance auto``: α
    fitted from measured step times, speeds measured), equal speeds;
(c) naive with rank 1 at ``--slow-speed`` (``--rank-speed 1:S``, slowed by sleeping);
(d) poise with the same slow rank.

Both packers train the same pieces in every step and the session weighs each rank's loss by
its share of the step's tokens, so their gradients are the same and so is their eval loss:
what differs is the time. Per run: the whole run's mean per-step balance and from
``--settle-steps`` on (poise measures speeds over its first steps), real tokens per second,
the ceiling of the second half's balance (what a perfect plan would reach given how much
each step's time strayed from its cost model: the machine's noise), the eval loss (bits
per byte), planning milliseconds per step and their share of the median step; per speed
setting, poise over naive. The machine's load average is recorded
before and after (a shared machine's other work slows every run alike, never the plan).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table

HELP = "packed sequences (documents in fixed-length rows, attention per document): naive packing vs poise's"

RUNS = {"a": ("naive", False), "b": ("poise", False), "c": ("naive", True), "d": ("poise", True)}


def run_row(name: str, report: dict[str, Any], settle_steps: int) -> dict[str, Any]:
    """The table's figures of one run from its report."""
    per_step = report["balance_per_step"]
    packing = report.get("packing") or {}
    plan_ms = packing.get("plan_ms_per_step")
    step_ms = 1e3 * report["median_step_s"]
    return {
        "run": name,
        "packer": packing.get("packer"),
        "rank_speed": report["config"]["emulate"]["rank_speed"] or "equal",
        "balance": report["balance"],
        "balance_settled": float(np.mean(per_step[settle_steps:])) if len(per_step) > settle_steps else None,
        # what a perfect plan would reach over the run's second half, given how much each step's
        # time strayed from its cost model on the machine then (its noise)
        "balance_ceiling": report.get("balance_ceiling_last_half"),
        "tokens_per_s": report["throughput_tokens_per_s"],
        "eval_loss": report["eval_loss"],
        "median_step_ms": step_ms,
        "plan_ms_per_step": plan_ms,
        "plan_share": plan_ms / step_ms if plan_ms is not None and step_ms > 0 else None,
    }


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """poise over naive for each speed setting run by both: tokens/s, balance and eval loss ratios."""
    out = []
    for speed in dict.fromkeys(r["rank_speed"] for r in rows):
        pair = {r["packer"]: r for r in rows if r["rank_speed"] == speed}
        if "naive" in pair and "poise" in pair:
            naive, poise = pair["naive"], pair["poise"]
            out.append({"run": f"poise / naive ({speed})", "rank_speed": speed,
                        "balance": poise["balance"] / naive["balance"],
                        "tokens_per_s": poise["tokens_per_s"] / naive["tokens_per_s"],
                        "eval_loss": poise["eval_loss"] / naive["eval_loss"]})
    return out


def markdown_table(result: dict[str, Any]) -> str:
    """The runs and the ratios as the Markdown table docs/balancing.md quotes, so that the
    page is written from the results file and a test can check it still says what the file
    says. Pure."""
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"| run | rank speed | balance | balance from step {result['settle_steps']} | ceiling | tokens/s "
             "| eval bits/byte | step ms | planning ms/step | planning / step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['run']} | {r['rank_speed']} | {fmt(r['balance'], '.3f')} | "
                     f"{fmt(r['balance_settled'], '.3f')} | {fmt(r.get('balance_ceiling'), '.3f')} | "
                     f"{fmt(r['tokens_per_s'], ',.0f')} | "
                     f"{fmt(r['eval_loss'], '.3f')} | {fmt(r['median_step_ms'], ',.0f')} | "
                     f"{fmt(r['plan_ms_per_step'], '.2f')} | {fmt(r['plan_share'], '.2%')} |")
    for r in result["ratios"]:
        lines.append(f"| **{r['run']}** | | **{r['balance']:.2f}x** | | | **{r['tokens_per_s']:.2f}x** | "
                     f"**{r['eval_loss']:.3f}x** | | | |")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> None:
    """Print the tables of a results dict (``packed.json``): the runs, then poise over naive."""
    def num(fmt: str):
        return lambda v: "-" if v is None else format(v, fmt)

    title = (f"poise bench packed: code-lm packed into rows of {result['row_tokens']} bytes, {result['rows']} rows "
             f"per rank per step, {result['nproc']} workers, {result['steps']} steps")
    show_table(title, result["runs"], [
        ("run", "run", str), ("rank_speed", "rank speed", str), ("balance", "balance", num(".3f")),
        ("balance_settled", f"from step {result['settle_steps']}", num(".3f")),
        ("balance_ceiling", "ceiling", num(".3f")),
        ("tokens_per_s", "tokens/s", num(",.0f")), ("eval_loss", "eval bits/byte", num(".3f")),
        ("median_step_ms", "step ms", num(",.0f")), ("plan_ms_per_step", "plan ms/step", num(".2f")),
        ("plan_share", "plan / step", num(".2%"))])
    show_table("poise over naive", result["ratios"], [
        ("run", "run", str), ("balance", "balance", num(".2f")), ("tokens_per_s", "tokens/s", num(".2f")),
        ("eval_loss", "eval loss", num(".3f"))])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--row-tokens", type=int, default=2048, help="bytes in one packed row (task.max_seq_len)")
    parser.add_argument("--rows", type=int, default=4, help="rows per rank per step (the naive packer's)")
    parser.add_argument("--nproc", type=int, default=2, help="workers (2; 4 as an option)")
    parser.add_argument("--slow-speed", type=float, default=0.5, help="(c, d): the speed of rank 1, in (0, 1]")
    parser.add_argument("--settle-steps", type=int, default=10,
                        help="steps left out of the settled balance (poise's first speed measurements)")
    parser.add_argument("--runs", default="a,b,c,d", help="which runs, by letter (a-d, comma-separated)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit per run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-packed-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every run, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "row_tokens", "rows", "nproc", "timeout_s")
    if not 0 < args.slow_speed <= 1:
        raise ValueError(f"--slow-speed={args.slow_speed} is outside (0, 1]")
    letters = [x.strip() for x in args.runs.split(",") if x.strip()]
    if not letters or any(x not in RUNS for x in letters):
        raise ValueError(f"--runs={args.runs!r}: allowed are the letters a-d, comma-separated (e.g. a,b)")
    out = output_dir(args.out, "packed")
    common = ["--task", "code-lm", "--task.packed", "true", "--max-seq-len", str(args.row_tokens),
              "--task.d_model", "64", "--task.num_layers", "2", "--task.num_heads", "4",
              "--task.eval_max_samples", "256", "--nproc", str(args.nproc), "--steps", str(args.steps),
              "--batch-size", str(args.rows), "--emulate.slowdown_method", "sleep", *args.train_args]
    flags: dict[str, list[str]] = {}
    for letter in letters:
        packer, slow = RUNS[letter]
        flags[f"{letter}-{packer}{'-slow' if slow else ''}"] = [
            *common, "--balance", "static" if packer == "naive" else "auto",
            *(["--rank-speed", f"1:{args.slow_speed}"] if slow else [])]
    load_before = os.getloadavg()
    rows = [run_row(name, run_train_job(name, out, job, args.timeout_s), args.settle_steps)
            for name, job in flags.items()]
    result = {"steps": args.steps, "row_tokens": args.row_tokens, "rows": args.rows, "nproc": args.nproc,
              "slow_speed": args.slow_speed, "settle_steps": args.settle_steps,
              "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
              "runs": rows, "ratios": compare(rows), "flags": flags}
    table(result)
    save_results(out, "packed", result)
    return 0
