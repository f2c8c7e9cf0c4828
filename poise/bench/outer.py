"""``poise bench outer``: per-step and outer-step synchronization side by side, at equal loss, over shaped links.

On an emulated cluster of ``--nodes`` × ``--procs-per-node`` workers (default 2 × 2; network
namespaces behind tbf-shaped links, ``poise cluster``), the realistic-batch workload (code-lm,
d_model 512, 6 layers, 16 sequences of 32 bytes per rank per step: ``network.py``'s model at
``--batch-size 16``) is trained by each run of ``--runs``:

- ``ddp``: plain DDP (the reference); ``torch-powersgd``: torch's PowerSGD hook;
  ``powersgd-early``: poise's best per-step codec (PowerSGD from step 5);
- ``torch-localsgd``: torch's post-local SGD (``post_localSGD_hook`` + ``PeriodicModelAverager``,
  5 warm-up steps of DDP, then gradients averaged within each node and parameters across nodes
  every ``inner_steps``);
- ``torchft-diloco``: torchft 0.2.0's ``DiLoCo`` (optional extra ``poise[bench]``), which runs on
  gloo and across the emulated nodes. Where it cannot be imported or its job fails, its
  faithful equivalent ``diloco-as-torchft`` runs instead and the table and JSON say so:
  poise's DiLoCo with torchft's behaviour (equal weighting of the replicas, no compression, the
  static sharding, every outer step waiting for the slowest worker), which computes the same
  parameters as torchft's (``tests/dist/test_sync_baselines.py``);
- ``diloco``, ``streaming-int8`` (Streaming DiLoCo with int8 outer deltas) and ``auto`` (poise's
  choice between per-step and outer-step synchronization, from measurements);
- ``local-sgd-node``, ``diloco-node``, ``streaming-int8-node``: the same with
  ``sync.inner_scope=node`` (each node's workers one replica, gradients all-reduced every step
  within the node, the outer step between nodes only: torch's post-local SGD layout), not in
  the default ``--runs``.

Each at every link of ``--links`` (rates such as ``1gbit``, and ``floor``), and at each link of
``--slow-links`` once more with worker 1 at half speed (``--rank-speed 1:0.5``). The floor is
the same job on the same 2 × 2 cluster with its links at 100 Gbit/s, the top rate poise shapes
to and more than a veth pair carries on one machine: effectively unshaped, with the node
layout kept (torch's subgroups and torchft's addresses are then the same as on the shaped runs).

Equal loss: ``ddp`` runs ``--steps`` steps (default 200: 10 outer rounds at ``inner_steps``
20) and its final eval loss (the first link's, per seed) is the target; every other run may
take ``--extra-steps`` more with the reference's learning-rate schedule, evaluates every
``--eval-every`` steps and stops once it reaches the target. Per run: training seconds to the
target (evaluations left out; linear between evaluations; "not reached"), speed-up against
``ddp`` and, at equal loss, against torchft's DiLoCo at the same link (at the loss torchft's run
ended at: it rarely reaches DDP's), the ratio to the same run at the floor, its seconds for
the reference's steps and its eval loss there (equal tokens) against DDP's, the final eval
loss, each worker's compute utilization (its forward, backward and optimizer seconds over its
seconds in steps: ``report.json``'s ``per_rank``) and the bytes every worker sent per token
trained (``wire_bytes_per_token``). With several ``--seeds``, the rows are medians over the
seeds (a run that did not reach the target counts as slower than any that did), with the
lowest and highest seed beside each, and the per-seed runs are in the JSON too.

The cluster needs root (``ip``, ``tc``); each job brings its own cluster up and down.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.bench.network import MODEL_ARGS, time_to_target
from poise.log import make_console
from poise.sync.torchft_diloco import load_torchft
from poise.units import link_rate_bit_per_s

HELP = "DDP, per-step codecs, torch's local SGD, torchft's and poise's DiLoCo: time to DDP's loss over shaped links"

EQUIVALENT = "diloco-as-torchft"
# (label, poise train flags): the reference first
# inner steps of every outer-step run: at this bench's horizon (100-200 steps) fewer rounds cost
# more accuracy than the outer all-reduces cost time (code-lm, 4 workers, 100 steps: plain
# averaging reached 2.92 at H=5, 2.98 at H=10; DiLoCo's Nesterov step 3.21 at H=10; DDP 2.74)
INNER = ("--sync.inner_steps", "5")
# poise's own runs re-plan shares from measured speeds (a half-speed worker gets half the samples)
DYNAMIC = ("--balance", "dynamic")
RUNS: dict[str, tuple[str, ...]] = {
    "ddp": ("--codec", "none"),
    "torch-powersgd": ("--codec", "torch-powersgd"),
    "powersgd-early": ("--codec", "powersgd", "--comm.start_step", "5"),
    "torch-localsgd": ("--sync", "torch-localsgd", "--comm.start_step", "5", *INNER),
    "torchft-diloco": ("--sync", "torchft-diloco", *INNER),
    EQUIVALENT: ("--sync", "diloco", "--sync.weighting", "equal", "--balance", "static", *INNER),
    "local-sgd": ("--sync", "local_sgd", *INNER, *DYNAMIC),
    "diloco": ("--sync", "diloco", *INNER, *DYNAMIC),
    "streaming-int8": ("--sync", "streaming", "--sync.codec", "int8", "--sync.fragments", "5", *INNER, *DYNAMIC),
    "auto": ("--sync", "auto", *DYNAMIC),
}
# the outer runs again with a node's workers as one replica (DDP within the node every step)
NODE = ("--sync.inner_scope", "node")
RUNS |= {f"{label}-node": (*RUNS[label], *NODE) for label in ("local-sgd", "diloco", "streaming-int8")}
DEFAULT_RUNS = ("ddp", "powersgd-early", "torch-localsgd", "torchft-diloco", "local-sgd", "diloco",
                "streaming-int8", "auto")
FLOOR = "floor"
FLOOR_RATE = "100gbit"
SLOW_RANK = ("--rank-speed", "1:0.5")
SLOW_NOTE = "worker 1 at half speed"


def realistic(model: Sequence[str] = MODEL_ARGS) -> list[str]:
    """``model`` with 16 sequences per rank per step (``--batch-size 16``), the realistic batch."""
    out = list(model)
    out[out.index("--batch-size") + 1] = "16"
    return out


@dataclass(frozen=True)
class Plan:
    """The runs: the cluster (``nodes:workers``), steps of the reference, the share of extra
    steps the others get (``extra``), evaluations every ``eval_every`` steps, the seeds, and
    each job's limit in seconds."""

    cluster: str
    steps: int
    extra: float
    eval_every: int
    seeds: tuple[int, ...]
    timeout_s: float
    short_links: tuple[str, ...] = ()
    short_steps: int = 10
    target: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--links", default=f"1gbit,10gbit,100mbit,{FLOOR}",
                        help=f"link rates, comma-separated; '{FLOOR}' = the same cluster at {FLOOR_RATE} (unshaped)")
    parser.add_argument("--slow-links", default="1gbit",
                        help=f"links where the runs go once more with {SLOW_NOTE} ('' = none)")
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    parser.add_argument("--procs-per-node", type=int, default=2, help="workers per node")
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"training runs: {', '.join(RUNS)}")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps of the reference run (ddp); 200 = 10 outer rounds at sync.inner_steps 20")
    parser.add_argument("--extra-steps", type=float, default=0.25,
                        help="the other runs may take this share more steps to reach the reference's loss")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (time to accuracy)")
    parser.add_argument("--short-links", default="100mbit",
                        help="links where ddp runs --short-steps only and its time to the target is extrapolated: "
                             "its median step times --steps ('' = none)")
    parser.add_argument("--short-steps", type=int, default=10, help="steps of the short ddp runs")
    parser.add_argument("--target", type=float, default=None,
                        help="target eval loss (default: the first full ddp run's final eval loss); given, ddp "
                             "may be left out or run short")
    parser.add_argument("--seeds", default="0", help="seeds, comma-separated (rows are medians over them)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit per job, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-outer-<timestamp>)")
    parser.add_argument("train_args", nargs="*",
                        help=f"'poise train' flags after --, replacing the default model ({' '.join(realistic())})")


def parse(args: argparse.Namespace) -> tuple[list[tuple[str, bool]], list[str], Plan]:
    """The variants ``(link, slow)`` in run order, the run labels and the plan, or a one-line
    ValueError for the first bad flag."""
    require_positive(args, "nodes", "procs_per_node", "steps", "eval_every", "timeout_s", "short_steps")
    if not (math.isfinite(args.extra_steps) and 0 <= args.extra_steps <= 10):
        raise ValueError(f"--extra-steps={args.extra_steps} must be in 0..10 (a share of --steps)")
    links = _names(args.links, "--links")
    slow = _names(args.slow_links, "--slow-links") if args.slow_links.strip() else []
    for link in links + slow:
        if link != FLOOR:
            link_rate_bit_per_s(link)  # one line naming a bad rate
    if len(set(links)) != len(links) or len(set(slow)) != len(slow):
        raise ValueError(f"--links={args.links!r} and --slow-links={args.slow_links!r} must not repeat a link")
    labels = _names(args.runs, "--runs")
    unknown = [x for x in labels if x not in RUNS]
    if unknown:
        raise ValueError(f"--runs: unknown {', '.join(unknown)}; allowed are {', '.join(RUNS)}")
    if args.target is not None and not (math.isfinite(args.target) and args.target > 0):
        raise ValueError(f"--target={args.target} must be a positive eval loss")
    if "ddp" not in labels and args.target is None:
        raise ValueError(f"--runs={args.runs!r} must include ddp: its final eval loss is every run's target")
    if len(set(labels)) != len(labels):
        raise ValueError(f"--runs={args.runs!r} repeats a run")
    labels.sort(key=lambda x: x != "ddp")  # the reference first
    try:
        seeds = tuple(int(s) for s in _names(args.seeds, "--seeds"))
    except ValueError:
        seeds = ()
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds={args.seeds!r} is invalid: give distinct integers >= 0 separated by commas")
    short = tuple(_names(args.short_links, "--short-links")) if args.short_links.strip() else ()
    if all(link in short for link in links) and args.target is None:
        raise ValueError(f"--short-links={args.short_links!r} covers every link of --links: ddp must run in full "
                         "at one link to set the target")
    # a full shaped link first (its ddp sets the target), then short ones, the floor last; slow variants after
    variants = sorted([(link, False) for link in links], key=lambda v: (v[0] == FLOOR, v[0] in short)) + [
        (link, True) for link in slow]
    plan = Plan(f"{args.nodes}:{args.procs_per_node}", args.steps, args.extra_steps, args.eval_every, seeds,
                args.timeout_s, short, args.short_steps, args.target)
    return variants, labels, plan


def _names(text: str, flag: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"{flag}={text!r} is empty: give a comma-separated list")
    return names


def run(args: argparse.Namespace) -> int:
    variants, labels, plan = parse(args)
    torchft_error = None
    if "torchft-diloco" in labels:
        try:
            load_torchft()
        except ValueError as exc:  # its equivalent runs instead; said in the table and the JSON
            torchft_error = str(exc)
            labels[labels.index("torchft-diloco")] = EQUIVALENT
            make_console().print(f"torchft-diloco cannot run here, {EQUIVALENT} instead: {torchft_error}")
    model = list(args.train_args) or realistic()
    out = output_dir(args.out, "outer")
    runs: list[dict[str, Any]] = []
    for seed in plan.seeds:
        target: dict[str, float | None] = {"loss": plan.target}
        for link, slow in variants:
            for label in labels:
                runs += _one(out, link, slow, label, seed, model, plan, target)
    rows = summarize(runs)
    show(rows, plan)
    save_results(out, "outer", {"cluster": plan.cluster, "variants": [list(v) for v in variants],
                                "runs_asked": labels, "plan": dataclasses.asdict(plan), "model_args": model,
                                "floor": f"{plan.cluster} at {FLOOR_RATE}", "slow": " ".join(SLOW_RANK),
                                "torchft_error": torchft_error, "rows": rows, "runs": runs})
    return 0


def _one(out: Path, link: str, slow: bool, label: str, seed: int, model: list[str], plan: Plan,
         target: dict[str, float | None]) -> list[dict[str, Any]]:
    """One job (and, if torchft's fails, its equivalent's): the per-seed rows."""
    name = f"s{seed}-{link}{'-slow' if slow else ''}-{label}"
    try:
        report = run_train_job(name, out, job_flags(label, link, slow, seed, model, plan, target["loss"]),
                               plan.timeout_s)
    except RuntimeError as exc:
        if label != "torchft-diloco":
            raise
        make_console().print(f"{name} failed, {EQUIVALENT} runs instead: {exc}")
        failed = {"run": label, "link": link, "slow": slow, "seed": seed, "error": str(exc)}
        return [failed, *_one(out, link, slow, EQUIVALENT, seed, model, plan, target)]
    short = label == "ddp" and link in plan.short_links
    if label == "ddp" and target["loss"] is None and not short:
        target["loss"] = float(report["eval_loss"])
    row = measure(report, target["loss"], plan.steps)
    if short:  # DDP reaches its own final loss at its last step: its median step times --steps
        row["time_to_target_s"] = row["train_s_at_reference_steps"] = float(report["median_step_s"]) * plan.steps
        row["extrapolated"] = True
    return [{"run": label, "link": link, "slow": slow, "seed": seed, **row}]


def job_flags(label: str, link: str, slow: bool, seed: int, model: Sequence[str], plan: Plan,
              target: float | None) -> list[str]:
    """``poise train`` flags of one run (without ``--out``)."""
    steps = plan.steps if label == "ddp" else math.ceil(plan.steps * (1 + plan.extra))
    if label == "ddp" and link in plan.short_links and not slow:
        steps = plan.short_steps
    flags = [*model, "--steps", str(steps), "--seed", str(seed), "--cluster", plan.cluster,
             "--link", FLOOR_RATE if link == FLOOR else link, "--train.eval_every", str(plan.eval_every), *RUNS[label]]
    if slow:
        flags += SLOW_RANK
    if label != "ddp":  # the reference's schedule; stop once its loss is reached
        flags += ["--train.schedule_steps", str(plan.steps)]
        if target is not None:
            flags += ["--train.stop_at_eval_loss", repr(target)]
    return flags


def measure(report: dict[str, Any], target: float | None, reference_steps: int | None = None) -> dict[str, Any]:
    """A run's figures from its ``report.json``: time to ``target`` from ``eval_curve``,
    ``compute_utilization`` per worker (``per_rank``: forward, backward and optimizer seconds
    over its seconds in steps, emulated slowness counted as compute) and ``bytes_per_token``
    (``wire_bytes_per_token``: every byte the workers put into collectives over every token
    they trained; outer steps send rarely, so a per-step median would read 0)."""
    curve = report["eval_curve"]
    at_reference = [e for e in curve if e["step"] == reference_steps] if reference_steps else []
    return {
        "steps": int(report["steps"]),
        # at equal tokens: the eval loss after the reference's steps (every run's batch is the same)
        "eval_loss_at_reference_steps": float(at_reference[0]["loss"]) if at_reference else None,
        # and the training seconds it took to get there (the speed at equal steps)
        "train_s_at_reference_steps": float(at_reference[0]["train_s"]) if at_reference else None,
        "time_to_target_s": time_to_target(curve, target) if target is not None else None,
        "target_eval_loss": target,
        "final_eval_loss": float(report["eval_loss"]),
        "compute_utilization": [float(r["compute_utilization"]) for r in report["per_rank"]],
        "bytes_per_token": float(report["wire_bytes_per_token"]),
        "train_s": float(curve[-1]["train_s"]) if curve else None,
        "sync": report.get("sync"),
        "eval_curve": [{"step": int(e["step"]), "train_s": float(e["train_s"]), "loss": float(e["loss"])}
                       for e in curve],
    }


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(statistics.median(known)) if known else None


def _spread(values: list[float | None]) -> list[float] | None:
    """``[min, max]`` of the known values over the seeds (None when none is known)."""
    known = [v for v in values if v is not None]
    return [float(min(known)), float(max(known))] if known else None


def _median_time(values: list[float | None]) -> float | None:
    """Median seconds, a run that never reached the target counting as slower than any that did."""
    median = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(median) else float(median)


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (link, slow, run): medians over the seeds, then the ratios between rows.

    ``speedup_vs_ddp``: DDP's time to the target over this run's, at the same link and variant;
    ``speedup_at_equal_steps``: DDP's training seconds for its steps over this run's for as many
    steps (the speed per step, whatever the loss). The spreads (``*_range``: ``[min, max]`` over
    the seeds; ``reached``: how many seeds reached the target) go beside the medians.
    ``speedup_vs_torchft_diloco``: at equal loss with torchft's ``DiLoCo`` (or its equivalent
    where it did not run: ``torchft_reference`` names which), which rarely reaches DDP's loss:
    the loss it ended at (``torchft_loss``, per seed), its time to first reach it over this
    run's (0 where this run never did; median over seeds). ``floor_ratio``: this run's time over
    its own time at the floor (the issue's target: at most 1.15); ``loss_vs_target_pct``.
    """
    groups: dict[tuple[str, bool, str], list[dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault((r["link"], r["slow"], r["run"]), []).append(r)
    rows = []
    for (link, slow, label), group in groups.items():
        utilization = [statistics.median(u) if None not in u else None
                       for u in zip(*(g["compute_utilization"] for g in group), strict=True)]
        per_token = [g["bytes_per_token"] for g in group if g["bytes_per_token"] is not None]
        times = [g["time_to_target_s"] for g in group]
        at_steps = [g.get("train_s_at_reference_steps") for g in group]
        losses = [g.get("eval_loss_at_reference_steps") for g in group]
        rows.append({"run": label, "link": link, "slow": slow, "seeds": [g["seed"] for g in group],
                     "extrapolated": any(g.get("extrapolated") for g in group),
                     "steps": statistics.median(g["steps"] for g in group),
                     "time_to_target_s": _median_time(times), "time_to_target_range_s": _spread(times),
                     "reached": sum(t is not None for t in times),
                     "train_s_at_reference_steps": _median_or_none(at_steps),
                     "train_s_at_reference_steps_range": _spread(at_steps),
                     "target_eval_loss": statistics.median(g["target_eval_loss"] for g in group
                                                           if g["target_eval_loss"] is not None)
                     if any(g["target_eval_loss"] is not None for g in group) else None,
                     "final_eval_loss": statistics.median(g["final_eval_loss"] for g in group),
                     "eval_loss_at_reference_steps": _median_or_none(losses),
                     "eval_loss_at_reference_steps_range": _spread(losses),
                     "compute_utilization": utilization,
                     "min_compute_utilization": min((u for u in utilization if u is not None), default=None),
                     "bytes_per_token": statistics.median(per_token) if per_token else None})
    by_key = {(r["link"], r["slow"], r["run"]): r for r in rows}
    for row in rows:
        here = (row["link"], row["slow"])
        ddp = by_key.get((*here, "ddp"))
        torchft = by_key.get((*here, "torchft-diloco")) or by_key.get((*here, EQUIVALENT))
        row["torchft_reference"] = torchft["run"] if torchft else None
        floor = by_key.get((FLOOR, False, row["run"]))
        row["speedup_vs_ddp"] = _ratio(ddp, row)
        row["speedup_at_equal_steps"] = _ratio(ddp, row, "train_s_at_reference_steps")
        row["torchft_loss"], row["speedup_vs_torchft_diloco"] = (
            _at_torchft_loss(groups[(*here, torchft["run"])], groups[(*here, row["run"])]) if torchft else (None, None))
        row["floor_ratio"] = _ratio(row, floor) if floor is not None and row["link"] != FLOOR else None
        target = row["target_eval_loss"]
        row["loss_vs_target_pct"] = 100 * (row["final_eval_loss"] / target - 1) if target else None
    return rows


def _at_torchft_loss(torchft: Sequence[dict[str, Any]], runs: Sequence[dict[str, Any]]) -> tuple[float, float | None]:
    """The median of torchft's final eval losses, and of its time to first reach its own
    final loss over each run's time to that loss, seed by seed (0 where a run never reached it:
    slower than any that did; None when the median is such a run)."""
    final = {r["seed"]: r for r in torchft}
    ratios = []
    for run in runs:
        reference = final.get(run["seed"])
        if reference is None:
            continue
        loss = reference["final_eval_loss"]
        base, mine = time_to_target(reference["eval_curve"], loss), time_to_target(run["eval_curve"], loss)
        ratios.append(base / mine if base and mine else 0.0)
    losses = [r["final_eval_loss"] for r in torchft]
    median = statistics.median(ratios) if ratios else 0.0
    return float(statistics.median(losses)), (float(median) if median > 0 else None)


def _ratio(base: dict[str, Any] | None, row: dict[str, Any] | None, key: str = "time_to_target_s") -> float | None:
    """``base``'s seconds (``key``: to the target) over ``row``'s (None when either has none)."""
    if base is None or row is None or not base.get(key) or not row.get(key):
        return None
    return base[key] / row[key]


def _with_spread(row: dict[str, Any], key: str, fmt: str, none: str = "-") -> str:
    """The median, and its seeds' ``[min, max]`` after it where there are several seeds."""
    value, spread = row.get(key), row.get(f"{key}_range")
    if value is None:
        return none
    text = format(value, fmt)
    if len(row["seeds"]) < 2 or spread is None:
        return text
    return f"{text} ({format(spread[0], fmt)}-{format(spread[1], fmt)})"


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the table's text cells: the variant, and each median with its spread and ratio."""
    def ratio(key: str) -> str:
        return "" if row.get(key) is None else f" ({row[key]:.2f}x)"

    some = f", {row['reached']}/{len(row['seeds'])} seeds" if 0 < row["reached"] < len(row["seeds"]) else ""
    return {**row, "run": row["run"] + (" (time extrapolated)" if row.get("extrapolated") else ""),
            "variant": f"{row['link']}{', ' + SLOW_NOTE if row['slow'] else ''}"
            + (f" [{FLOOR_RATE}]" if row["link"] == FLOOR else ""),
            "to_target": _with_spread(row, "time_to_target_s", ".1f", "not reached") + some + ratio("speedup_vs_ddp"),
            "at_steps": _with_spread(row, "train_s_at_reference_steps", ".1f") + ratio("speedup_at_equal_steps"),
            "loss_at_steps": _with_spread(row, "eval_loss_at_reference_steps", ".4f")}


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def show(rows: Sequence[dict[str, Any]], plan: Plan) -> None:
    """The rich table of :func:`summarize`'s rows."""
    reference = {r["torchft_reference"] for r in rows if r["torchft_reference"]}
    versus = ("vs torchft DiLoCo" if reference <= {"torchft-diloco"} else f"vs {EQUIVALENT}"
              if reference == {EQUIVALENT} else "vs torchft DiLoCo (its equivalent where torchft's failed)")
    shown = [_cells(r) for r in rows]
    targets = sorted({r["target_eval_loss"] for r in rows if r["target_eval_loss"] is not None})
    seeds = plan.seeds
    show_table(f"poise bench outer: time to ddp's eval loss after {plan.steps} steps "
               f"({', '.join(f'{t:.4f}' for t in targets) or 'none'}) on {plan.cluster} (nodes:workers), "
               f"{'median (min-max) of seeds ' if len(seeds) > 1 else 'seed '}{','.join(map(str, seeds))}", shown, [
        ("variant", "link", str),
        ("run", "run", str),
        ("steps", "steps run", lambda v: f"{v:g}"),
        ("to_target", "time to target, s (vs DDP)", str),
        ("speedup_vs_torchft_diloco", f"{versus} (at its final loss)", _x),
        ("floor_ratio", "time / floor's", _x),
        ("at_steps", f"s for {plan.steps} steps (vs DDP)", str),
        ("loss_at_steps", f"eval loss after {plan.steps} steps", str),
        ("final_eval_loss", "final eval loss", lambda v: f"{v:.4f}"),
        ("compute_utilization", "compute utilization per worker",
         lambda v: " ".join("-" if u is None else f"{u:.2f}" for u in v)),
        ("bytes_per_token", "bytes/token", lambda v: "-" if v is None else f"{v:,.0f}"),
    ])
    if any(r["run"] == EQUIVALENT for r in rows):
        make_console().print(f"{EQUIVALENT}: poise's DiLoCo with torchft's behaviour (equal weighting, no compression, "
                             "static sharding, every outer step waiting for the slowest worker; the same parameters "
                             "as torchft's DiLoCo, tests/dist/test_sync_baselines.py), where torchft's did not run or "
                             "was asked for (torchft_error and failed jobs: in the JSON)")
