"""``poise demo``: what poise changes, in one command (``make demo``), in a few minutes on 2 cores.

Real ``poise train`` jobs, side by side, in comparisons: a baseline first, then the runs measured
against it.

1. **A slow rank.** code-lm on 2 workers with rank 1 emulated at half speed
   (``--rank-speed 1:0.5``), three runs: static sharding (torch's DistributedSampler, what plain
   DDP does), poise with no settings (``--balance auto``, the default: DDP's own steps, each
   split by cost and by the ranks' measured speeds into ranges of similar lengths) and
   ``--balance dynamic`` (length bucketing too, which changes the steps' samples). auto / static
   is what poise gives without a setting, dynamic / auto what length bucketing adds on top.
   Then ``poise diagnose run`` on the static run, which names the slow rank.
2. **A slow network** (needs root, ``ip`` and ``tc``; elsewhere one line says why it is
   skipped). A two-node emulated cluster behind 1 Gbit/s links (``--cluster 2:1 --link
   1gbit``) trains the widened model of ``poise bench network``: plain DDP (``--codec none``)
   against a compressed run (:data:`COMPRESSED_FLAGS`).

It ends with one comparison table (balance, idle share, tokens/s, median step, eval loss,
bytes per step; ratio rows: each run over the baseline, and each run after the second over the
one before it), a line crediting the slow-rank gain to its two causes, ``compare.png`` (the
runs' per-rank timelines side by side) and ``demo.json``, and prints where they are. Figures are
what this machine measured in this invocation; nothing is precomputed.
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

HELP = ("what poise changes: plain DDP vs poise with no settings vs dynamic balancing with a slow rank, DDP vs "
        "compressed over a slow link")

# The compressed run of the network comparison: poise train flags (the codec and its settings).
COMPRESSED_FLAGS: tuple[str, ...] = ("--codec", "powersgd")

# The slow-rank comparison: code-lm on 2 local workers, rank 1 at this speed (1 = full speed).
SLOW_RANK, SLOW_SPEED = 1, 0.5
# held-out samples evaluated at the end of each balance run: enough for a stable eval loss,
# a quarter of the default's seconds
EVAL_SAMPLES = 128


@dataclass(frozen=True)
class Run:
    """One job of a comparison."""

    name: str  # short name: the run directory's suffix and the run's name in ratio rows
    label: str  # what the run is, for the table and the plot
    flags: list[str]  # poise train flags


@dataclass(frozen=True)
class Comparison:
    """Runs of one setting side by side; ``runs[0]`` is the baseline the others are measured against."""

    key: str  # short name, the prefix of the run directories
    title: str  # what is compared, for the table and the plot
    runs: tuple[Run, ...]

    def ratios(self) -> list[tuple[int, int]]:
        """(run, over run) index pairs of the ratio rows: every run over the baseline, then every run
        after the second over the one before it (what that run adds)."""
        return [(i, 0) for i in range(1, len(self.runs))] + [(i, i - 1) for i in range(2, len(self.runs))]


# (report key, header, formatter); a ratio row divides a run's figure by another's
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
    # 30 and 12: dynamic's first re-plan comes at step 5 (or 10, when the first steps are noisy) and
    # the compressed run compresses from step 2, so most steps run as settled; these counts keep
    # make demo, five jobs with its three slow-rank runs, within 4 minutes of a fresh clone on 2 cores
    parser.add_argument("--steps", type=int, default=30, help="steps of each slow-rank run")
    parser.add_argument("--network-steps", type=int, default=12, help="steps of each slow-network run")
    parser.add_argument("--link", default="1gbit", help="the emulated cluster's link rate")
    parser.add_argument("--network", choices=("auto", "off"), default="auto",
                        help="auto: run the slow-network comparison where root, ip and tc are available; "
                             "off: skip it")
    parser.add_argument("--slowdown", choices=("sleep", "cgroup", "auto"), default="sleep",
                        help="how rank 1 is slowed (--emulate.slowdown_method): sleeping in proportion to its "
                             "compute holds on a busy machine too; a cgroup CPU quota binds only on an idle one")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per job, seconds")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every job, after --")


def comparisons(args: argparse.Namespace) -> list[Comparison]:
    """The comparisons this invocation runs (the network one only where it can)."""
    slow = ["--task", "code-lm", "--nproc", "2", "--steps", str(args.steps), "--task.eval_max_samples",
            str(EVAL_SAMPLES), "--rank-speed", f"{SLOW_RANK}:{SLOW_SPEED}", "--emulate.slowdown_method",
            args.slowdown]
    chosen = [Comparison("slow-rank", f"rank {SLOW_RANK} at {SLOW_SPEED:g} speed, 2 workers", (
        Run("static", "plain DDP (static sharding)", [*slow, "--balance", "static"]),
        Run("auto", "poise, no settings", [*slow, "--balance", "auto"]),
        Run("dynamic", "poise dynamic (+ length bucketing)", [*slow, "--balance", "dynamic"]),
    ))]
    if args.network_reason is None:
        link = ["--steps", str(args.network_steps), "--cluster", "2:1", "--link", args.link, *MODEL_ARGS]
        codec = " ".join(COMPRESSED_FLAGS).replace("--codec ", "")
        chosen.append(Comparison("slow-link", f"2 nodes over {args.link} links", (
            Run("ddp", "plain DDP", [*link, "--codec", "none"]),
            Run("compressed", f"poise {codec}", [*link, *COMPRESSED_FLAGS]),
        )))
    return chosen


def network_reason(mode: str) -> str | None:
    """Why the slow-network comparison cannot run here (one line), or None when it can."""
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
    chosen = comparisons(args)
    total = sum(len(c.runs) for c in chosen)
    console.print(f"[bold]poise demo[/]: {total} real training jobs, side by side; outputs in {out}/")
    if args.network_reason is not None:
        console.print(f"slow-network comparison skipped: {args.network_reason}", highlight=False)
    results: list[dict[str, Any]] = []
    diagnosis: dict[str, Any] | None = None
    for comparison in chosen:
        for index, job in enumerate(comparison.runs):
            name = f"{comparison.key}-{job.name}"
            count = len(results) + 1
            with console.status(f"[{count}/{total}] {comparison.title}: {job.label} ..."):
                job_started = time.perf_counter()
                report = run_train_job(name, out, [*job.flags, *args.train_args, "--overwrite"], args.timeout_s)
            wall_s = time.perf_counter() - job_started
            console.print(f"[{count}/{total}] {comparison.title}: {job.label}: {wall_s:.0f} s, "
                          f"balance {report['balance']:.3f}, {report['throughput_tokens_per_s']:,.0f} tokens/s",
                          highlight=False)
            results.append({"comparison": comparison.key, "title": comparison.title,
                            "role": "run" if index else "baseline", "name": job.name, "run": job.label,
                            "dir": str(out / name), "wall_s": wall_s,
                            **{key: float(report[key]) for key, _, _ in METRICS}})
        if comparison.key == "slow-rank":
            diagnosis = show_diagnosis(console, out / f"{comparison.key}-{comparison.runs[0].name}")
    rows = comparison_rows(chosen, results)
    show_comparison(console, rows)
    credit = credit_line(rows)
    if credit:
        console.print(credit, highlight=False)
    groups: list[tuple[int, ...]] = []
    for comparison in chosen:
        start = sum(len(g) for g in groups)
        groups.append(tuple(range(start, start + len(comparison.runs))))
    png = plot_timelines(
        [(f"{r['title']}\n{r['run']}\n{r['median_step_s'] * 1e3:,.0f} ms/step, balance {r['balance']:.2f}",
          load_table(Path(r["dir"]) / "timeline.npz")) for r in results],
        out / "compare.png", title="poise demo: per-rank seconds per step, the runs of a comparison side by side",
        groups=groups)
    wall_s = time.perf_counter() - started
    save_results(out, "demo", {"wall_s": wall_s, "network_skipped": args.network_reason, "runs": results,
                               "ratios": [r for r in rows if r["role"] == "ratio"], "credit": credit,
                               "diagnosis": diagnosis, "compressed_flags": list(COMPRESSED_FLAGS),
                               "flags": {f"{c.key}-{job.name}": job.flags for c in chosen for job in c.runs}})
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


def comparison_rows(chosen: Sequence[Comparison], results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each comparison's run rows, then its ratio rows (:meth:`Comparison.ratios`): one run's figure
    over another's for every metric (None where the divisor is 0, e.g. no idle time at all).
    ``results``: the run rows, in the order of the comparisons' runs."""
    rows: list[dict[str, Any]] = []
    start = 0
    for comparison in chosen:
        runs = results[start:start + len(comparison.runs)]
        start += len(comparison.runs)
        if [r["name"] for r in runs] != [job.name for job in comparison.runs]:
            raise ValueError(f"comparison_rows: the results do not match the runs of {comparison.key!r}")
        rows += runs
        for i, j in comparison.ratios():
            top, bottom = runs[i], runs[j]
            rows.append({"comparison": comparison.key, "title": "", "role": "ratio", "of": top["name"],
                         "over": bottom["name"], "run": f"{top['name']} / {bottom['name']}",
                         **{key: (top[key] / bottom[key] if bottom[key] else None) for key, _, _ in METRICS}})
    if start != len(results):
        raise ValueError(f"comparison_rows: {len(results)} results for {start} runs")
    return rows


def credit_line(rows: Sequence[dict[str, Any]]) -> str:
    """Where the slow-rank gain in tokens/s comes from, in one line: poise with no settings (auto
    over static: DDP's samples split by speed and length) and length bucketing (dynamic over
    auto, which changes the steps' samples), whose product is dynamic over static. Empty when a
    ratio is missing."""
    ratio = {(r["of"], r["over"]): r["throughput_tokens_per_s"] for r in rows
             if r["role"] == "ratio" and r["comparison"] == "slow-rank"}
    no_settings, bucketing = ratio.get(("auto", "static")), ratio.get(("dynamic", "auto"))
    total = ratio.get(("dynamic", "static"))
    if no_settings is None or bucketing is None or total is None:
        return ""
    return (f"where the slow-rank gain in tokens/s comes from: poise with no settings (auto: DDP's samples split by "
            f"speed and length) {no_settings:.2f}x static's, length bucketing (dynamic, other samples per step) a "
            f"further {bucketing:.2f}x, {total:.2f}x in all")


def markdown_table(results: dict[str, Any]) -> str:
    """The comparison table of a ``demo.json`` (its ``runs`` and ``ratios``) as the README and the
    docs quote it: each comparison's runs, then its ratio rows in bold. Pages quote this text
    whole, so that a figure can only change with the file it comes from
    (tests/unit/test_docs_figures.py)."""
    lines = ["| comparison | run | " + " | ".join(header for _, header, _ in METRICS) + " |",
             "|" + "---|" * (2 + len(METRICS))]
    for comparison in dict.fromkeys(r["comparison"] for r in results["runs"]):
        for row in results["runs"]:
            if row["comparison"] == comparison:
                title = row["title"] if row["role"] == "baseline" else ""
                cells = [fmt(row[key]) for key, _, fmt in METRICS]
                lines.append(f"|{' ' + title if title else ''} | {row['run']} | " + " | ".join(cells) + " |")
        for row in results["ratios"]:
            if row["comparison"] == comparison:
                cells = ["-" if row[key] is None else f"**{row[key]:.2f}x**" for key, _, _ in METRICS]
                lines.append(f"| | **{row['run']}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def show_comparison(console: Any, rows: Sequence[dict[str, Any]]) -> None:
    """The comparison table: one row per run, then each comparison's ratio rows."""
    from rich.table import Table

    table = Table(title="poise demo: each comparison's runs, and their ratios")
    table.add_column("comparison")
    table.add_column("run")
    for _, header, _ in METRICS:
        table.add_column(header, justify="right")
    for n, row in enumerate(rows):
        last = n + 1 == len(rows) or rows[n + 1]["comparison"] != row["comparison"]
        if row["role"] == "ratio":
            cells = ["-" if row[key] is None else f"{row[key]:.2f}x" for key, _, _ in METRICS]
            table.add_row("", f"[bold]{row['run']}[/]", *(f"[bold]{c}[/]" for c in cells), end_section=last)
        else:
            table.add_row(row["title"] if row["role"] == "baseline" else "", row["run"],
                          *(fmt(row[key]) for key, _, fmt in METRICS), end_section=last)
    console.print(table)
