"""``poise bench stragglers``: plain DDP against deadline steps under random worker delays.

Real ``poise train`` jobs of a small code-lm (1 thread per worker, so 4 workers share this
machine's 2 cores), for each world size, delay model and seed, side by side:

- ``delay-free``: plain DDP, no delays: the reference;
- ``ddp``: plain DDP (every rank waits for the slowest) under the delays;
- ``deadline``: straggler-tolerant steps (``--straggler deadline``);
- ``deadline+stale``: the same, a rank that computed nothing sends its previous gradient.

Every delay model is at "20 %": its mean inflation of a rank's compute is 0.2 (the table's
title defines each). ``--models none`` runs the modes without delays: what a mode costs or
saves by itself against the delay-free run. Delays are sleeps (see
``poise/emulate/delays.py``): a delayed rank gives its core away, which at 4 workers on 2
cores lets the others run faster meanwhile; at 2 workers each has its own core and a delay is
time lost.

Per run: throughput (trained samples/s over the training steps after the first, the window
of the CPU figures below; the job's time in steps is the busiest rank's, its step times
summed: under deadline steps a stalled rank's step overlaps the others' next one, see
:func:`poise.diagnostics.timeline.elapsed_s`) against the delay-free run
of the same world size and seed (run first and again after each delay model's runs, and
interpolated linearly to the time each run ended: this machine's speed moved by up to 17 %
within one seed's runs, and bracketing every model's few runs cancels a drift that is steady
over a few minutes, not only over the whole seed); the two factors of that throughput,
each against the delay-free runs the same way: the share of the machine's cores busy over the
training steps (what the schedule left idle) and the busy CPU time per trained sample (the
machine's own speed, and any CPU a mode or the delays cost; both from ``/proc/stat``:
:func:`poise.bench.cpu.cpu_trace`); and, from the ranks' own timelines, the share of their
processes' CPU spent outside forward and backward (what a mode's machinery costs; a share
within one run, so the machine's speed hardly moves it) and their compute CPU per sample
against delay-free (the machine's speed, and the micro-batches' shapes: the delay-free run
computes each rank's batch at once, the other modes in micro-batches, padded only to their own
longest sample); p50 and p99 step time (the growth of the job's time in steps), the
share of planned micro-batches deferred, training loss at equal real tokens against
delay-free (mean over seeds), wall time to the delay-free run's loss, and samples trained
twice within an epoch (from the per-step sample records). Medians over seeds. Then every
predictor scored on the recorded micro-batch traces (median absolute error, one step ahead,
against the next observation and against its compute alone), and an epoch of the digits
task under each model with ``deadline``: every sample trained exactly once.

Writes ``stragglers.json``: one row per run (``run``, ``world_size``, ``delay_model``, ``mode``,
``throughput_vs_delay_free``, ``loss_vs_delay_free``, ``p99_step_s``, ...), the setup the
runs share (``steps``, ``batch_size``, ``micro_batches``, ``seeds``, read from their configs),
the predictor scores and the epoch checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from poise.bench.balance import loss_at_tokens
from poise.bench.cpu import cpu_trace, cpu_use
from poise.bench.harness import output_dir, positive_ints, require_positive, run_train_job, save_results, show_table
from poise.config import DelaySpec
from poise.diagnostics.report import steady_throughput
from poise.diagnostics.timeline import column, elapsed_s, load_table
from poise.straggler.predict import PREDICTORS, evaluate

HELP = "plain DDP vs deadline steps under 20% random worker delays (world sizes 2 and 4)"

MODELS = {
    "bernoulli": "bernoulli:p=0.2,x=1",
    "lognormal": "lognormal:mean=0.2,sigma=1",
    "pareto": "pareto:mean=0.2,alpha=2.5",
    "slow-rank": "slow:rank=1,x=0.2",
}
# --models: the delay models, and none: each mode without delays, against the delay-free run
# (plain steps of whole batches): what the mode costs or saves by itself (micro-batches, machinery)
CHOICES = {"none": "none", **MODELS}
MODES = {"ddp": "off", "deadline": "deadline", "deadline+stale": "deadline+stale"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"delay models among {', '.join(MODELS)}, or none (each mode without delays)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"modes among {', '.join(MODES)}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per rank per step (64: micro-batches of 8; at 4 samples each, cutting a step "
                             "into micro-batches costs this small model 6%% by itself)")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per rank per step (8: 8 samples each; the finer the micro-batches, the "
                             "closer together the ranks end a step, since they claim work one micro-batch at a time)")
    parser.add_argument("--no-epoch-check", action="store_true", help="skip the digits epochs")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per run, seconds")
    parser.add_argument("--from", dest="from_dir", default="",
                        help="recompute the tables from a finished run's directory (no jobs)")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-stragglers-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags for every run, after --")


def _choices(text: str, allowed: dict[str, str], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{flag}={text!r}: allowed are {', '.join(allowed)}")
    return names


def duplicates_per_epoch(out: Path) -> tuple[int, dict[int, list[int]]]:
    """Samples trained more than once within an epoch, from the run's sample records; and
    each epoch's trained indices."""
    epochs: dict[int, list[int]] = {}
    for path in sorted((out / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            epochs.setdefault(int(entry["epoch"]), []).extend(int(i) for i in entry["indices"])
    return sum(len(v) - len(set(v)) for v in epochs.values()), epochs


SMOOTH_STEPS = 10  # training loss is compared as a running mean over this many steps


def smoothed_loss_at(report: dict[str, Any], tokens: float, window: int = SMOOTH_STEPS) -> float:
    """The running mean (``window`` steps) of the training loss at the last step within ``tokens``."""
    curve = np.asarray(report["loss_curve"])
    last = max(int(np.searchsorted(curve[:, 0], tokens, side="right")), 1)
    return float(curve[max(0, last - window):last, 1].mean())


def time_to_loss(curve: list[list[float]], elapsed: list[float], target: float,
                 window: int = SMOOTH_STEPS) -> float | None:
    """Seconds of training steps (``elapsed``: the job's time in steps by each step's end,
    :func:`poise.diagnostics.timeline.elapsed_s`) until the running mean (``window`` steps) of
    the training loss (``curve``: the report's ``loss_curve``) first reaches ``target``; None:
    never."""
    losses = np.array([v for _, v in curve])
    times = np.asarray(elapsed)
    for s in range(window, len(losses) + 1):
        if losses[s - window:s].mean() <= target + 1e-12:
            return float(times[s - 1])
    return None


CPU_TRACE = "cpu.txt"  # per job: the machine's CPU time while it ran (poise.bench.cpu.cpu_trace)


def _cpu_row(job: Path, table: np.ndarray) -> dict[str, float | None]:
    """CPU figures over the job's training steps after the first (None where not measured):

    - ``cores_busy``: the share of all the machine's cores busy (its CPU trace);
    - ``cpu_ms_per_sample``: the machine's busy CPU milliseconds per sample trained;
    - ``compute_cpu_ms_per_sample``: the ranks' training threads' CPU milliseconds in forward
      and backward per sample (the timeline's ``compute_cpu_s``): the model's own cost, which
      moves with the machine's speed and the micro-batches' shapes, not with scheduling;
    - ``cpu_outside_compute``: the share of the ranks' processes' CPU (``cpu_s``) spent
      outside forward and backward: data, optimizer, communication threads, the deadline
      machinery (claims, watchdog, count all-reduce).

    ``table``: the job's timeline."""
    starts, steps = column(table, "start_time_s")[:, 1:], column(table, "step_s")[:, 1:]
    samples = float(column(table, "samples")[:, 1:].sum())
    cpu, compute = (float(column(table, name)[:, 1:].sum()) for name in ("cpu_s", "compute_cpu_s"))
    measured = samples > 0 and np.isfinite(cpu) and np.isfinite(compute) and cpu > 0
    row: dict[str, float | None] = {
        "compute_cpu_ms_per_sample": 1000 * compute / samples if measured else None,
        "cpu_outside_compute": 1.0 - compute / cpu if measured else None,
    }
    use = None if starts.size == 0 else cpu_use(job / CPU_TRACE, float(starts[:, 0].min()),
                                                float((starts + steps)[:, -1].max()))
    if use is None:
        return {**row, "cores_busy": None, "cpu_ms_per_sample": None}
    return {**row, "cores_busy": use[0], "cpu_ms_per_sample": 1000 * use[1] / samples if samples else None}


def _row(name: str, world: int, model: str, mode: str, seed: int, rep: dict[str, Any], out: Path) -> dict[str, Any]:
    table = load_table(out / name / "timeline.npz")
    elapsed = elapsed_s(table)
    # each step as the job lived it (the growth of its time in steps), after the first, which
    # builds buckets and warms up; not each step's slowest rank: see elapsed_s
    steps = np.diff(elapsed)
    summaries = [s for s in rep.get("straggler") or [] if s]
    planned = sum(s["micro_planned"] for s in summaries)
    dup, _ = duplicates_per_epoch(out / name)
    return {
        **_cpu_row(out / name, table),
        "run": name, "world_size": world, "delay_model": model, "mode": mode, "seed": seed,
        "finished_s": (out / name / "report.json").stat().st_mtime,  # wall clock, for the reference's drift
        # over the steps after the first, like the CPU figures (from the timeline, so --from
        # recomputes it for runs whose reports summed each step's slowest rank)
        "throughput_samples_per_s": steady_throughput(table)[0],
        "p50_step_s": float(np.median(steps)), "p99_step_s": float(np.quantile(steps, 0.99)),
        "deferred_share": sum(s["micro_deferred"] for s in summaries) / planned if planned else 0.0,
        "stale_steps": sum(s["stale_steps"] for s in summaries),
        "samples_duplicated": dup,
        "tokens": rep["loss_curve"][-1][0],
        "_report": rep,
        "_elapsed_s": elapsed.tolist(),
    }


def _score_predictors(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every predictor on the recorded traces of the deadline runs, per delay model."""
    scores = []
    for model in sorted({r["delay_model"] for r in rows if r["mode"] == "deadline"}):
        traces = [s["trace"] for r in rows if r["mode"] == "deadline" and r["delay_model"] == model
                  for s in r["_report"]["straggler"] if s and len(s["trace"]) > 20]
        entry: dict[str, Any] = {"delay_model": model, "traces": len(traces)}
        for name in PREDICTORS:
            results = [evaluate([a for a, _ in t], name, typical=[b for _, b in t]) for t in traces]
            entry[f"{name}_mdape"] = statistics.median(x["mdape"] for x in results) if results else None
            entry[f"{name}_mdape_compute"] = statistics.median(x["mdape_typical"] for x in results) if results else None
        best = min(PREDICTORS, key=lambda n: entry[f"{n}_mdape_compute"] or float("inf"))
        entry["best"] = best
        scores.append(entry)
    return scores


def _epoch_checks(args: argparse.Namespace, out: Path, models: list[str], world: int) -> list[dict[str, Any]]:
    """An epoch of digits with ``deadline`` under each model: every sample once."""
    checks = []
    for model in models:
        name = f"epoch-w{world}-{model}"
        run_train_job(name, out, ["--task", "digits", "--nproc", str(world), "--epochs", "1", "--batch-size", "16",
                                  "--dist.threads_per_worker", "1", "--straggler", "deadline", "--delay",
                                  CHOICES[model], "--diagnostics.record_samples", "true", *args.train_args],
                      args.timeout_s)
        checks.append(_epoch_check(out, name, model))
    return checks


def _epoch_check(out: Path, name: str, model: str) -> dict[str, Any]:
    dup, epochs = duplicates_per_epoch(out / name)
    summaries = [s for s in json.loads((out / name / "report.json").read_text())["straggler"] if s]
    trained = epochs.get(0, [])
    return {"run": name, "delay_model": model, "trained": len(trained), "distinct": len(set(trained)),
            "samples_duplicated": dup, "deferred_share": sum(s["micro_deferred"] for s in summaries)
            / max(1, sum(s["micro_planned"] for s in summaries))}


def run(args: argparse.Namespace) -> int:
    require_positive(args, "seeds", "steps", "batch_size", "micro_batches", "timeout_s")
    worlds = positive_ints(args.worlds, "--worlds")
    models = _choices(args.models, CHOICES, "--models")
    modes = _choices(args.modes, MODES, "--modes")
    if args.from_dir:
        out = Path(args.from_dir)
        rows, checks = _read_back(out)
        return _tables(out, rows, checks, sorted({r["delay_model"] for r in rows} - {"none"}))
    out = output_dir(args.out, "stragglers")
    rows: list[dict[str, Any]] = []
    for world in worlds:
        for seed in range(args.seeds):
            common = ["--task", "code-lm", "--task.d_model", "128", "--task.num_layers", "2", "--max-seq-len", "256",
                      "--batch-size", str(args.batch_size), "--nproc", str(world), "--steps", str(args.steps),
                      "--seed", str(seed), "--dist.threads_per_worker", "1", "--task.eval_max_samples", "16",
                      "--diagnostics.record_samples", "true", "--straggler.micro_batches", str(args.micro_batches),
                      *args.train_args]
            # a delay-free run first and after each delay model's runs (see module doc: drift)
            jobs = [(f"w{world}-delay-free-s{seed}", "none", "delay-free", common)]
            for model in models:
                jobs += [(f"w{world}-{model}-{mode}-s{seed}", model, mode,
                          [*common, "--straggler", MODES[mode], "--delay", CHOICES[model]])
                         for mode in modes]
                jobs.append((f"w{world}-delay-free-after-{model}-s{seed}", "none", "delay-free", common))
            for name, model, mode, flags in jobs:
                with cpu_trace(out / name / CPU_TRACE):
                    report = run_train_job(name, out, flags, args.timeout_s)
                rows.append(_row(name, world, model, mode, seed, report, out))
    checks = [] if args.no_epoch_check else _epoch_checks(args, out, models, max(worlds))
    return _tables(out, rows, checks, models)


def _read_back(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of a finished run's directory (``--from``): its jobs' reports, by name."""
    rows, checks = [], []
    for report in sorted(out.glob("*/report.json")):
        name = report.parent.name
        if name.startswith("epoch-"):
            checks.append(_epoch_check(out, name, name.split("-", 2)[2]))
            continue
        world, rest = name[1:].split("-", 1)
        rest, seed = rest.rsplit("-s", 1)
        if rest.startswith("delay-free"):
            model, mode = "none", "delay-free"
        else:
            model = next(m for m in CHOICES if rest.startswith(m + "-"))
            mode = rest[len(model) + 1:]
        rows.append(_row(name, int(world), model, mode, int(seed), json.loads(report.read_text()), out))
    if not rows:
        raise ValueError(f"--from={str(out)!r} holds no finished runs of poise bench stragglers")
    return rows, checks


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _tables(out: Path, rows: list[dict[str, Any]], checks: list[dict[str, Any]], models: list[str]) -> int:
    setup = _setup(rows)  # first: runs of two setups are refused before any work
    _compare(rows)
    table = _summary(rows)
    show_table(
        f"poise bench stragglers: code-lm d128x2 (256 bytes), {setup['steps']} steps, batch {setup['batch_size']}/rank "
        f"in {setup['micro_batches']} micro-batches, 1 thread per worker on this machine's cores, medians over "
        f"{setup['seeds']} seed(s). Delays (each a 20% mean inflation): " + "; ".join(
            f"{m} = {DelaySpec.parse(CHOICES[m]).describe()}" for m in models),
        table,
        [
            ("world_size", "world", str), ("delay_model", "delays", str), ("mode", "mode", str),
            ("throughput_vs_delay_free", "throughput vs delay-free", lambda v: f"{v:.3f}"),
            ("throughput_pooled_vs_delay_free", "pooled over seeds", lambda v: f"{v:.3f}"),
            ("cores_busy", "cores busy", _share), ("cores_busy_vs_delay_free", "busy vs delay-free", _ratio),
            ("cpu_per_sample_vs_delay_free", "CPU/sample vs delay-free", _ratio),
            ("compute_cpu_per_sample_vs_delay_free", "compute CPU/sample vs delay-free", _ratio),
            ("cpu_outside_compute", "ranks' CPU outside compute", _share),
            ("p50_step_s", "p50 step s", lambda v: f"{v:.3f}"), ("p99_step_s", "p99 step s", lambda v: f"{v:.3f}"),
            ("deferred_share", "deferred", lambda v: f"{v:.1%}"),
            ("loss_vs_delay_free", "loss vs delay-free", lambda v: f"{v:+.2%}"),
            ("time_to_loss_vs_delay_free", "time to loss vs delay-free",
             lambda v: "never" if v is None else f"{v:.2f}"),
            ("samples_duplicated", "dup", str),
        ],
    )
    scores = _score_predictors(rows)
    show_table("predictors on the recorded micro-batch traces (median |error| one step ahead; against the next "
               "observation, and against its compute alone)", scores,
               [("delay_model", "delays", str), ("traces", "traces", str),
                *[(f"{n}_{k}", f"{n} {label}", lambda v: "-" if v is None else f"{v:.1%}")
                  for n in PREDICTORS for k, label in (("mdape", "next"), ("mdape_compute", "compute"))],
                ("best", "best", str)])
    if checks:
        show_table("an epoch of digits under each delay model, deadline steps: every sample trained once",
                   checks, [("run", "run", str), ("trained", "trained", str), ("distinct", "distinct", str),
                            ("samples_duplicated", "dup", str), ("deferred_share", "deferred", lambda v: f"{v:.1%}")])
    for r in rows:
        r.pop("_report")
        r.pop("_elapsed_s")
    save_results(out, "stragglers", {**setup,
                                     "models": {m: CHOICES[m] for m in models},
                                     "runs": rows, "summary": table, "predictors": scores, "epoch_checks": checks})
    return 0


def _setup(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Steps, samples per rank per step and micro-batches per rank per step, read from the
    runs' own resolved configs (a table recomputed with ``--from`` describes the runs it
    read, not this call's flags), and the number of seeds.

    Raises:
        ValueError: the runs disagree on one of them (one line naming it and the values).
    """
    keys = {"steps": ("train", "steps"), "batch_size": ("train", "batch_size"),
            "micro_batches": ("straggler", "micro_batches")}
    setup = {"seeds": len({r["seed"] for r in rows})}
    for key, (section, field) in keys.items():
        values = sorted({int(r["_report"]["config"][section][field]) for r in rows})
        if len(values) != 1:
            raise ValueError(f"the runs disagree on {section}.{field} ({', '.join(map(str, values))}): "
                             "one table compares runs of one setup")
        setup[key] = values[0]
    return setup


def _compare(rows: list[dict[str, Any]]) -> None:
    """Each run against the delay-free runs of its world size and seed: their throughput
    interpolated to the time the run ended (constant outside them, or with one of them);
    losses against the first (the delay-free runs of a seed train the same samples)."""
    free: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in sorted((r for r in rows if r["mode"] == "delay-free"), key=lambda r: r["finished_s"]):
        free.setdefault((r["world_size"], r["seed"]), []).append(r)
    common = {w: min(r["tokens"] for r in rows if r["world_size"] == w) for w in {r["world_size"] for r in rows}}
    for r in rows:
        refs = free[(r["world_size"], r["seed"])]
        ref = refs[0]
        tokens = common[r["world_size"]]
        for key, ratio in (("throughput_samples_per_s", "throughput_vs_delay_free"),
                           ("cores_busy", "cores_busy_vs_delay_free"),
                           ("cpu_ms_per_sample", "cpu_per_sample_vs_delay_free"),
                           ("compute_cpu_ms_per_sample", "compute_cpu_per_sample_vs_delay_free")):
            known = [x for x in refs if x[key] is not None]
            reference = np.interp(r["finished_s"], [x["finished_s"] for x in known],
                                  [x[key] for x in known]) if known and r[key] is not None else None
            r[ratio] = None if reference is None else r[key] / float(reference)
        loss, ref_loss = (loss_at_tokens(x["_report"]["loss_curve"], tokens) for x in (r, ref))
        r["loss_at_common_tokens"] = loss
        r["loss_vs_delay_free"] = loss / ref_loss - 1.0
        # the delay-free run's smoothed loss where the shortest run of the world size ends
        target = smoothed_loss_at(ref["_report"], tokens)
        t, t_ref = (time_to_loss(x["_report"]["loss_curve"], x["_elapsed_s"], target) for x in (r, ref))
        r["time_to_loss_s"] = t
        r["time_to_loss_vs_delay_free"] = None if t is None or not t_ref else t / t_ref


def _median_known(values: Any) -> float | None:
    """The median of the values that are not None (None: none is known)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over seeds per (world, model, mode); the loss change is the mean over seeds.

    ``throughput_pooled_vs_delay_free``: the mean throughput over seeds against the delay-free
    runs' mean. Each seed's ratio divides by one delay-free run, whose own run-to-run noise on
    this machine (about ±5 %) then moves every ratio of that seed together; pooling averages it.
    """
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["world_size"], r["delay_model"], r["mode"]), []).append(r)
    free = {w: statistics.mean(r["throughput_samples_per_s"] for r in rows if r["world_size"] == w
                               and r["mode"] == "delay-free") for w in {r["world_size"] for r in rows}}
    table = []
    for (world, model, mode), members in groups.items():
        times = [m["time_to_loss_vs_delay_free"] for m in members]
        table.append({
            "world_size": world, "delay_model": model, "mode": mode, "seeds": len(members),
            "throughput_vs_delay_free": statistics.median(m["throughput_vs_delay_free"] for m in members),
            "throughput_pooled_vs_delay_free": statistics.mean(m["throughput_samples_per_s"] for m in members)
            / free[world],
            **{key: _median_known(m[key] for m in members)
               for key in ("cores_busy", "cores_busy_vs_delay_free", "cpu_per_sample_vs_delay_free",
                           "compute_cpu_per_sample_vs_delay_free", "cpu_outside_compute")},
            "p50_step_s": statistics.median(m["p50_step_s"] for m in members),
            "p99_step_s": statistics.median(m["p99_step_s"] for m in members),
            "deferred_share": statistics.median(m["deferred_share"] for m in members),
            "loss_vs_delay_free": statistics.mean(m["loss_vs_delay_free"] for m in members),
            "time_to_loss_vs_delay_free": None if any(t is None for t in times) else statistics.median(times),
            "samples_duplicated": sum(m["samples_duplicated"] for m in members),
        })
    models, modes = ["none", *MODELS], ["delay-free", *MODES]
    return sorted(table, key=lambda r: (r["world_size"], models.index(r["delay_model"]), modes.index(r["mode"])))
