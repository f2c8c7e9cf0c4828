"""``poise demo``: what poise changes, in one command (``make demo``), in a few minutes on 2 cores.

Real ``poise train`` jobs, side by side, each a pair of a baseline and poise:

1. **A slow rank.** code-lm on 2 workers with rank 1 emulated at half speed
   (``--rank-speed 1:0.5``): static sharding (torch's DistributedSampler, what plain DDP does)
   against poise's dynamic balancing (cost-budget steps, re-planned from measured speeds).
   Then ``poise diagnose run`` on the static run, which names the slow rank.
2. **A slow network** (needs root, ``ip`` and ``tc``; elsewhere one line says why it is
   skipped). A two-node emulated cluster behind 1 Gbit/s links (``--cluster 2:1 --link
   1gbit``) trains the widened model of ``poise bench network``: plain DDP (``--codec none``)
   against a compressed run (:data:`COMPRESSED_FLAGS`).

It ends with one comparison table (balance, idle share, tokens/s, median step, eval loss,
bytes per step; poise / baseline as ratios), ``compare.png`` (the runs' per-rank timelines
side by side) and ``demo.json``, and prints where they are. Figures are what this machine
measured in this invocation; nothing is precomputed.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.bench.harness import require_positive, run_train_job, save_results
from poise.bench.network import MODEL_ARGS
from poise.cluster import net
from poise.diagnostics import rules
from poise.diagnostics.report import plot_timelines, show_findings
from poise.diagnostics.run import load_run
from poise.diagnostics.timeline import load_table
from poise.log import make_console
from poise.units import link_rate_bit_per_s

HELP = "what poise changes: static vs balanced with a slow rank, DDP vs compressed over a slow link"

# The compressed run of the network pair: poise train flags (the codec and its settings).
COMPRESSED_FLAGS: tuple[str, ...] = ("--codec", "powersgd")

# The slow-rank pair: code-lm on 2 local workers, rank 1 at this speed (1 = full speed).
SLOW_RANK, SLOW_SPEED = 1, 0.5
# held-out samples evaluated at the end of each balance run: enough for a stable eval loss,
# a quarter of the default's seconds
EVAL_SAMPLES = 128


@dataclass(frozen=True)
class Pair:
    """A comparison: a baseline job and the poise job that is measured against it."""

    key: str  # short name, the prefix of the two run directories
    title: str  # what is compared, for the table and the plot
    baseline: tuple[str, list[str]]  # (label, poise train flags)
    poise: tuple[str, list[str]]


# (report key, header, formatter); the ratio of every metric is poise / baseline
METRICS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("balance", "balance", lambda v: f"{v:.3f}"),
    ("idle_fraction", "idle", lambda v: f"{v:.1%}"),
    ("throughput_tokens_per_s", "tokens/s", lambda v: f"{v:,.0f}"),
    ("median_step_s", "step time", lambda v: f"{v * 1e3:,.0f} ms"),
    ("eval_loss", "eval loss (bits/byte)", lambda v: f"{v:.3f}"),
    ("bytes_communicated_per_step", "bytes/step", lambda v: f"{v / 1e6:,.2f} MB"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/demo", help="output directory (default runs/demo); the demo "
                        "replaces what an earlier demo wrote there")
    parser.add_argument("--steps", type=int, default=60, help="steps of each slow-rank run")
    parser.add_argument("--network-steps", type=int, default=20, help="steps of each slow-network run")
    parser.add_argument("--link", default="1gbit", help="the emulated cluster's link rate")
    parser.add_argument("--network", choices=("auto", "off"), default="auto",
                        help="auto: run the slow-network pair where root, ip and tc are available; off: skip it")
    parser.add_argument("--slowdown", choices=("sleep", "cgroup", "auto"), default="sleep",
                        help="how rank 1 is slowed (--emulate.slowdown_method): sleeping in proportion to its "
                             "compute holds on a busy machine too; a cgroup CPU quota binds only on an idle one")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per job, seconds")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every job, after --")


def pairs(args: argparse.Namespace) -> list[Pair]:
    """The comparisons this invocation runs (the network one only where it can)."""
    slow = ["--task", "code-lm", "--nproc", "2", "--steps", str(args.steps), "--task.eval_max_samples",
            str(EVAL_SAMPLES), "--rank-speed", f"{SLOW_RANK}:{SLOW_SPEED}", "--emulate.slowdown_method",
            args.slowdown]
    chosen = [Pair("slow-rank", f"rank {SLOW_RANK} at {SLOW_SPEED:g} speed, 2 workers",
                   ("static sharding", [*slow, "--balance", "static"]),
                   ("poise balancing", [*slow, "--balance", "dynamic"]))]
    if args.network_reason is None:
        link = ["--steps", str(args.network_steps), "--cluster", "2:1", "--link", args.link, *MODEL_ARGS]
        chosen.append(Pair("slow-link", f"2 nodes over {args.link} links",
                           ("plain DDP", [*link, "--codec", "none"]),
                           (f"poise {' '.join(COMPRESSED_FLAGS).replace('--codec ', '')}", [*link, *COMPRESSED_FLAGS])))
    return chosen


def network_reason(mode: str) -> str | None:
    """Why the slow-network pair cannot run here (one line), or None when it can."""
    if mode == "off":
        return "--network off"
    try:
        net.require_support()
    except net.NetError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "network_steps", "timeout_s")
    link_rate_bit_per_s(args.link)  # a bad rate is one line before anything starts
    started = time.perf_counter()
    console = make_console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.network_reason = network_reason(args.network)
    chosen = pairs(args)
    total = 2 * len(chosen)
    console.print(f"[bold]poise demo[/]: {total} real training jobs, side by side; outputs in {out}/")
    if args.network_reason is not None:
        console.print(f"slow-network pair skipped: {args.network_reason}", highlight=False)
    results: list[dict[str, Any]] = []
    diagnosis: dict[str, Any] | None = None
    for pair in chosen:
        for role, (label, flags) in (("baseline", pair.baseline), ("poise", pair.poise)):
            name = f"{pair.key}-{role}"
            count = len(results) + 1
            with console.status(f"[{count}/{total}] {pair.title}: {label} ..."):
                job_started = time.perf_counter()
                report = run_train_job(name, out, [*flags, *args.train_args, "--overwrite"], args.timeout_s)
            wall_s = time.perf_counter() - job_started
            console.print(f"[{count}/{total}] {pair.title}: {label}: {wall_s:.0f} s, balance {report['balance']:.3f}, "
                          f"{report['throughput_tokens_per_s']:,.0f} tokens/s", highlight=False)
            results.append({"pair": pair.key, "comparison": pair.title, "role": role, "run": label,
                            "dir": str(out / name), "wall_s": wall_s,
                            **{key: float(report[key]) for key, _, _ in METRICS}})
        if pair.key == "slow-rank":
            diagnosis = show_diagnosis(console, out / f"{pair.key}-baseline")
    rows = comparison_rows(results)
    show_comparison(console, rows)
    png = plot_timelines(
        [(f"{r['comparison']}\n{r['run']}: {r['median_step_s'] * 1e3:,.0f} ms/step, balance {r['balance']:.2f}",
          load_table(Path(r["dir"]) / "timeline.npz")) for r in results],
        out / "compare.png", title="poise demo: per-rank seconds per step, each baseline beside poise",
        pairs=[(i, i + 1) for i in range(0, len(results), 2)])
    wall_s = time.perf_counter() - started
    save_results(out, "demo", {"wall_s": wall_s, "network_skipped": args.network_reason, "runs": results,
                               "ratios": [r for r in rows if r["role"] == "ratio"], "diagnosis": diagnosis,
                               "compressed_flags": list(COMPRESSED_FLAGS),
                               "flags": {f"{p.key}-{role}": flags for p in chosen
                                         for role, (_, flags) in (("baseline", p.baseline), ("poise", p.poise))}})
    console.print(f"wrote {png}  (the runs' timelines side by side)")
    for r in results:
        console.print(f"  {r['dir']}/  {r['run']}: report.json, trace.json (open in https://ui.perfetto.dev), "
                      "timeline.npz", highlight=False)
    console.print(f"demo finished in {wall_s:.0f} s")
    return 0


def show_diagnosis(console: Any, run_dir: Path) -> dict[str, Any]:
    """``poise diagnose run`` on the static run: print its findings; return the straggler finding."""
    console.print(f"\n$ poise diagnose run {run_dir}", highlight=False)
    findings = rules.evaluate(load_run(run_dir))
    show_findings(console, findings, f"poise diagnose run {run_dir}")
    straggler = next(f for f in findings if f.rule == "straggler")
    if straggler.verdict == "problem" and straggler.rank == SLOW_RANK:
        console.print(f"the diagnosis names rank {straggler.rank}, the rank emulated at {SLOW_SPEED:g} speed\n")
    else:
        console.print(f"[yellow]the diagnosis did not name rank {SLOW_RANK} as a straggler[/] "
                      f"({straggler.verdict}: {straggler.summary}); is the machine busy?\n")
    return straggler.to_dict()


def comparison_rows(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair's baseline and poise rows, then a ratio row: poise / baseline for every metric
    (None where the baseline's figure is 0, e.g. no idle time at all)."""
    rows: list[dict[str, Any]] = []
    for baseline, poise in zip(results[0::2], results[1::2], strict=True):
        ratio = {key: (poise[key] / baseline[key] if baseline[key] else None) for key, _, _ in METRICS}
        rows += [baseline, poise, {"pair": poise["pair"], "comparison": "", "role": "ratio",
                                   "run": "poise / baseline", **ratio}]
    return rows


def show_comparison(console: Any, rows: Sequence[dict[str, Any]]) -> None:
    """The comparison table: one row per run and a ratio row per pair."""
    from rich.table import Table

    table = Table(title="poise demo: poise against the baseline")
    table.add_column("comparison")
    table.add_column("run")
    for _, header, _ in METRICS:
        table.add_column(header, justify="right")
    for row in rows:
        if row["role"] == "ratio":
            cells = ["-" if row[key] is None else f"{row[key]:.2f}x" for key, _, _ in METRICS]
            table.add_row("", f"[bold]{row['run']}[/]", *(f"[bold]{c}[/]" for c in cells), end_section=True)
        else:
            table.add_row(row["comparison"] if row["role"] == "baseline" else "", row["run"],
                          *(fmt(row[key]) for key, _, fmt in METRICS))
    console.print(table)
