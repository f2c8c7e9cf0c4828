"""``poise bench diagnose``: inject one cause per job, then check that ``poise diagnose run`` finds it.

Real ``poise train`` jobs of code-lm on 2 workers, all with cost balancing and the same small
model, differing in one thing each:

- ``clean``: nothing injected. No rule may report a problem.
- ``slow-rank``: rank 1 at half speed (``--rank-speed 1:0.5``; ``--slow-method``: the cgroup CPU
  quota, or sleeping in proportion to compute) -> ``straggler`` naming rank 1.
- ``slow-data``: every batch loads ``--data-delay-s`` slower on every rank
  (``--emulate.data_delay_s``, a sleep in the DataLoader's collate) -> ``input_pipeline``.
- ``slow-link``: the job on an emulated 2-node cluster behind ``--link`` (tbf-shaped veth
  links; needs root, ``ip``, ``tc``) -> ``communication``.
- ``crowded``: the job's processes pinned to one CPU (their affinity), so its 2 ranks share
  one core -> ``cpu_contention`` (every rank's training thread off the CPU about half of its
  compute; no comparison between ranks shows it, both are slow alike).
- ``aggressive-replan``: dynamic balancing with no damping (jump to every estimate, re-plan
  every step) while every rank's speed varies in bursts (``--noise`` held for ``--noise-steps``
  steps, drawn per rank) -> ``replan_oscillation``. Noise drawn afresh every step does not
  make poise's re-planner move at all: it holds while a move is within two standard errors.
  With the library's default damping the same bursts make shares reverse too (the re-planner
  follows each burst), so there is no "noise alone" control: bursts are real speed changes.

The confusion table has one row per job and one column per rule (``P`` problem, ``w`` warn,
``.`` ok); a job "found" its cause when the expected rule reports a problem (with the right
rank for the straggler), and a control passes when no rule reports one. Prints the table and
writes ``diagnose.json`` (every finding of every job). Figures are as measured on the machine
the bench ran on: a shared machine's other load shows up in them.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, NamedTuple

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.cluster import net
from poise.diagnostics import rules
from poise.diagnostics.run import load_run
from poise.log import make_console

HELP = ("one job per injected cause (slow rank, data, link, crowded cores, aggressive re-plans): does poise "
        "diagnose run find it")

SYMBOL = {"ok": ".", "warn": "w", "problem": "P"}


class Job(NamedTuple):
    """One injected cause: ``poise train`` flags beyond the common ones, the rule expected to
    report a problem (None: a control, nothing may), the rank it must name, and the CPUs the
    job may run on (None: all this process may)."""

    flags: list[str]
    expected: str | None
    rank: int | None = None
    cpus: set[int] | None = None


def jobs(args: argparse.Namespace) -> dict[str, Job]:
    """Every job of the bench, by name (see module doc)."""
    noise = ["--emulate.speed_noise", str(args.noise), "--emulate.speed_noise_steps", str(args.noise_steps),
             "--balance.cold_start_steps", "2"]
    local = ["--nproc", "2"]
    return {
        "clean": Job([*local, "--balance", "cost"], None),
        "slow-rank": Job([*local, "--balance", "cost", "--rank-speed", "1:0.5", "--emulate.slowdown_method",
                          args.slow_method], "straggler", 1),
        "slow-data": Job([*local, "--balance", "cost", "--emulate.data_delay_s", str(args.data_delay_s)],
                         "input_pipeline"),
        "slow-link": Job(["--balance", "cost", "--cluster", "2:1", "--link", args.link], "communication"),
        "crowded": Job([*local, "--balance", "cost"], "cpu_contention", cpus={min(os.sched_getaffinity(0))}),
        "aggressive-replan": Job([*local, "--balance", "dynamic", "--balance.confident_error", "1",
                                  "--balance.max_share_change", "1", "--balance.replan_every_steps", "1", *noise],
                                 "replan_oscillation"),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=80, help="steps per job")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (on average)")
    parser.add_argument("--data-delay-s", type=float, default=0.05, help="slow-data: extra seconds per batch")
    parser.add_argument("--link", default="20mbit", help="slow-link: the emulated cluster's link rate")
    parser.add_argument("--noise", type=float, default=1.0, help="aggressive-replan: mean stretch of compute")
    parser.add_argument("--noise-steps", type=int, default=5, help="aggressive-replan: steps that share one draw")
    parser.add_argument("--slow-method", default="sleep", choices=("auto", "cgroup", "sleep"),
                        help="slow-rank: how rank 1 is slowed (a cgroup quota binds only on an idle machine)")
    parser.add_argument("--jobs", default="", help="only these jobs, comma-separated (default: all)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-diagnose-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every job, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "batch_size", "timeout_s", "noise_steps")
    if not 0 < args.data_delay_s <= 60:
        raise ValueError(f"--data-delay-s={args.data_delay_s} is outside (0, 60] seconds")
    planned = jobs(args)
    chosen = [j.strip() for j in args.jobs.split(",") if j.strip()] or list(planned)
    unknown = [j for j in chosen if j not in planned]
    if unknown:
        raise ValueError(f"--jobs: {', '.join(unknown)} unknown: allowed are {', '.join(planned)}")
    skipped: dict[str, str] = {}
    if "slow-link" in chosen:
        try:
            net.require_support()
        except net.NetError as exc:
            skipped["slow-link"] = str(exc)
            chosen.remove("slow-link")
            make_console().print(f"slow-link skipped: {exc}")
    out = output_dir(args.out, "diagnose")
    common = ["--task", "code-lm", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
              "--max-seq-len", "128", "--task.eval_max_samples", "16", *args.train_args]
    rows: list[dict[str, Any]] = []
    for name in chosen:
        job = planned[name]
        started = time.perf_counter()
        report = run_train_job(name, out, [*common, *job.flags], args.timeout_s, cpus=job.cpus)
        findings = rules.evaluate(load_run(out / name))
        rows.append(score_job(name, job.expected, job.rank, findings, report, time.perf_counter() - started))
    columns = [("job", "job", str), ("expected", "expected", lambda v: v or "(nothing)")]
    columns += [(rule, rule, str) for rule in rules.RULES]
    columns += [("found", "found", lambda v: "yes" if v else "NO"), ("wall_s", "wall", lambda v: f"{v:.0f} s")]
    show_table(f"poise bench diagnose: code-lm, 2 workers, {args.steps} steps; P problem, w warn, . ok",
               [{**r, **{k: SYMBOL[v] for k, v in r["verdicts"].items()}} for r in rows], columns)
    found = all(r["found"] for r in rows)
    make_console().print(f"{sum(r['found'] for r in rows)} of {len(rows)} jobs diagnosed as injected"
                         + ("" if found else ": see diagnose.json"))
    save_results(out, "diagnose", {
        "steps": args.steps, "all_found": found, "skipped": skipped, "jobs": rows,
        "flags": {k: [*common, *planned[k].flags] for k in chosen},
    })
    return 0


def score_job(name: str, expected: str | None, rank: int | None, findings: list[rules.Finding],
              report: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One row of the confusion table: every rule's verdict, and whether the job was diagnosed
    as injected (its rule a problem, naming ``rank`` when given; a control: no problem at all)."""
    by_rule = {f.rule: f for f in findings}
    problems = [f.rule for f in findings if f.verdict == "problem"]
    if expected is None:
        found = not problems
    else:
        hit = by_rule[expected]
        found = hit.verdict == "problem" and (rank is None or hit.rank == rank)
    return {
        "job": name, "expected": expected, "expected_rank": rank, "found": found, "problems": problems,
        "verdicts": {f.rule: f.verdict for f in findings}, "wall_s": wall_s,
        "findings": [f.to_dict() for f in findings],
        "report": {k: report.get(k) for k in ("balance", "idle_fraction", "comm_fraction", "median_step_s",
                                              "emulated_slowdown")},
    }

