"""``poise plan``: predicted step time of every codec × collective × bucket size on a cluster.

Parses the cluster, the model and its compute, hands the numbers to the pure planner
(``poise/plan/``), prints the table, the recommendation and the heavy parameter blocks, and
with ``--json`` writes ``plan.json``. Every figure says whether it was measured or assumed.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from poise.units import format_size_bytes, parse_duration_s, parse_rate_bit_per_s

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("plan", help="predict step time per codec, collective and bucket size on a cluster",
                            description=__doc__.splitlines()[0])
    c = parser.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1, help="nodes")
    c.add_argument("--procs-per-node", type=int, default=1, help="workers (GPUs) per node")
    c.add_argument("--link", default="", metavar="RATE", help="inter-node rate of one NIC (400gbit, 50GB/s)")
    c.add_argument("--nics-per-node", type=int, default=1, help="NICs per node (8 for a rail-optimized GPU node)")
    c.add_argument("--latency", default="5us", help="inter-node latency per message (assumed unless measured), 5us")
    c.add_argument("--intra", default="", metavar="RATE", help="one worker's intra-node rate (900GB/s for NVLink)")
    c.add_argument("--intra-latency", default="1us", help="intra-node latency per message, 1us")
    c.add_argument("--busbw", default="", metavar="JSON",
                   help="poise diagnose busbw's busbw.json across nodes: fit the inter-node link from its all-reduce")
    m = parser.add_argument_group("model and compute")
    m.add_argument("--params", type=float, default=0.0, help="parameters (e.g. 7e9): a GPT-style decoder of that size")
    m.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of that decoder (assumed), 32000")
    m.add_argument("--profile", default="", metavar="DIR",
                   help="a run directory whose report.json holds a layer profile (poise pipeline): compute and layers")
    m.add_argument("--step-s", type=float, default=0.0, help="measured single-worker step, seconds")
    m.add_argument("--optimizer-s", type=float, default=0.0, help="optimizer seconds within a step")
    m.add_argument("--tokens-per-step", type=float, default=8192, help="tokens per worker per step (FLOPs estimate)")
    m.add_argument("--peak-flops", type=float, default=989e12, help="peak FLOP/s of a worker (H100/H200 bf16 dense)")
    m.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization assumed, 0.4")
    m.add_argument("--mem-bw", default="4800GB/s", metavar="RATE", help="device memory rate for codec kernels")
    k = parser.add_argument_group("codecs and choices")
    k.add_argument("--codec-results", default="", metavar="JSON",
                   help="poise bench codecs' codecs.json: the accuracy cost of each codec")
    k.add_argument("--codec-speeds", default="", metavar="JSON",
                   help="codecs.json whose kernel table gives the codec speeds")
    k.add_argument("--max-loss-increase", type=float, default=None, metavar="PCT",
                   help="loss budget: eval-loss increase over uncompressed, percent")
    k.add_argument("--codecs", default="", help="codecs to compare (default: every codec)")
    k.add_argument("--collectives", default="", help="collectives to compare (default: flat, ring, tree, hierarchical)")
    k.add_argument("--bucket-mb", default="1,5,25,100", help="bucket sizes to compare, MiB")
    k.add_argument("--top", type=int, default=0, help="rows to print (0: all)")
    k.add_argument("--json", action="store_true", help="write plan.json into --out")
    k.add_argument("--out", default=".", help="directory of plan.json, default .")
    parser.set_defaults(run=run)


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    if not text:
        return allowed
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{flag}={text!r}: unknown {', '.join(bad) or '(empty)'}; allowed are {', '.join(allowed)}")
    return names


def _read_json(path: str, flag: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path!r} cannot be read as JSON: {exc}") from None


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the planner needs from ``args``, with where each part came from."""
    from poise.plan import calibrate, planner
    from poise.plan.costs import Cluster, Link
    from poise.plan.model import transformer_params

    if args.nodes < 1 or args.procs_per_node < 1 or args.nics_per_node < 1:
        raise ValueError(f"--nodes={args.nodes}, --procs-per-node={args.procs_per_node} and --nics-per-node="
                         f"{args.nics_per_node} must be >= 1")
    for name in ("step_s", "optimizer_s", "tokens_per_step", "peak_flops", "mfu"):
        value = getattr(args, name)
        if value < 0 or (name in ("peak_flops", "mfu", "tokens_per_step") and not value > 0):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be {'positive' if value <= 0 else '>= 0'}")
    sources: dict[str, str] = {}
    if args.busbw:
        data = _read_json(args.busbw, "--busbw")
        inter = calibrate.fit_ring_link(calibrate.busbw_points(data), int(data["world_size"]))
        sources["inter-node link"] = f"measured: ring fit of {args.busbw}'s all-reduce"
    elif args.link:
        rate = parse_rate_bit_per_s(args.link, what="--link") / 8 * args.nics_per_node
        inter = Link(parse_duration_s(args.latency, what="--latency"), rate)
        sources["inter-node link"] = (f"given: {args.nics_per_node} x {args.link} per node; latency {args.latency} "
                                      "(assumed)")
    elif args.nodes > 1:
        raise ValueError("--link RATE (or --busbw JSON) is needed with more than one node")
    else:
        inter = Link(0.0, 1e30)
    if args.intra:
        intra = Link(parse_duration_s(args.intra_latency, what="--intra-latency"),
                     parse_rate_bit_per_s(args.intra, what="--intra") / 8)
        sources["intra-node link"] = f"given: {args.intra} per worker; latency {args.intra_latency} (assumed)"
    elif args.procs_per_node > 1:
        intra = inter if args.nodes > 1 else Link(0.0, 1e30)
        sources["intra-node link"] = "assumed: as the inter-node link (no --intra)"
    else:
        intra = inter
    cluster = Cluster(args.nodes, args.procs_per_node, intra, inter)
    sources["core sharing"] = ("assumed: none (every worker on its own cores; poise bench plan measures it on "
                               "the emulated cluster)")

    profile = None
    if args.profile:
        report = _read_json(str(Path(args.profile) / "report.json"), "--profile")
        if "profile" not in report:
            raise ValueError(f"--profile {args.profile!r}: its report.json holds no layer profile (run poise pipeline)")
        profile = report["profile"]
    if args.params:
        params, shape = transformer_params(args.params, vocab_size=args.vocab_size)
        sources["model"] = (f"assumed: GPT-style decoder, d_model {shape['d_model']}, {shape['num_layers']} blocks, "
                            f"vocabulary {shape['vocab_size']}, {shape['num_params']:.3g} parameters")
        num_params = float(shape["num_params"])
    elif profile is not None:
        backward = [t - f for t, f in zip(profile["time_s"], profile["forward_s"], strict=True)]
        params = planner.layer_params(profile["names"], profile["param_bytes"], backward)
        num_params = sum(profile["param_bytes"]) / 4
        sources["model"] = f"measured: {len(params)} profiled layers (shapes assumed near-square)"
    else:
        raise ValueError("give --params N or --profile DIR: the planner needs the model's parameters")
    if profile is not None:
        compute = calibrate.compute_from_profile(profile, optimizer_s=args.optimizer_s)
    elif args.step_s:
        compute = planner.split_step(args.step_s, args.optimizer_s)
    else:
        compute = planner.flops_compute(num_params, args.tokens_per_step, args.peak_flops, args.mfu, args.optimizer_s)
    sources["compute"] = compute.source
    if args.codec_speeds:
        data = _read_json(args.codec_speeds, "--codec-speeds")
        if not data.get("kernels"):
            raise ValueError(f"--codec-speeds {args.codec_speeds!r} holds no kernel table")
        speeds = calibrate.codec_speeds_from_kernels(data["kernels"], float(data["mbytes"]))
        sources["codec speeds"] = f"measured: {args.codec_speeds} kernel table (without error feedback)"
    else:
        speeds = planner.assumed_speeds(parse_rate_bit_per_s(args.mem_bw, what="--mem-bw") / 8)
        sources["codec speeds"] = f"assumed: memory passes per codec at {args.mem_bw}"
    costs = None
    if args.codec_results:
        costs = planner.loss_costs_from_results(_read_json(args.codec_results, "--codec-results"))
        sources["accuracy cost"] = f"measured: {args.codec_results} (eval loss vs none)"
    else:
        sources["accuracy cost"] = "unknown (no --codec-results): none is 0 by definition"
    buckets = [float(v) for v in args.bucket_mb.split(",") if v.strip()] if args.bucket_mb else []
    if not buckets or any(not b > 0 for b in buckets):
        raise ValueError(f"--bucket-mb={args.bucket_mb!r} is invalid: give positive MiB sizes separated by commas")
    return {"cluster": cluster, "params": params, "compute": compute, "speeds": speeds, "costs": costs,
            "sources": sources, "buckets": buckets,
            "codecs": _names(args.codecs, tuple(planner.CODEC_OPTIONS), "--codecs"),
            "collectives": _names(args.collectives, planner.COLLECTIVES, "--collectives")}


def run(args: argparse.Namespace) -> int:
    from poise.files import write_json_atomic
    from poise.log import make_console
    from poise.plan import planner

    inputs = build(args)
    cluster = inputs["cluster"]
    rows = planner.plan_all(cluster, inputs["params"], inputs["compute"], inputs["speeds"], inputs["costs"],
                            codecs=inputs["codecs"], collectives=inputs["collectives"], bucket_mb=inputs["buckets"])
    best = planner.recommend(rows, args.max_loss_increase)
    heavy = planner.heavy_params(inputs["params"])
    show(rows[: args.top or None], best, heavy, inputs, args.max_loss_increase)
    if args.json:
        c = inputs["cluster"]
        path = write_json_atomic(Path(args.out) / "plan.json", {
            "cluster": {"num_nodes": c.num_nodes, "procs_per_node": c.procs_per_node,
                        "intra": vars(c.intra), "inter": vars(c.inter)},
            "compute": vars(inputs["compute"]), "sources": inputs["sources"],
            "max_loss_increase_pct": args.max_loss_increase, "rows": [r.as_dict() for r in rows],
            "recommended": best.as_dict() if best else None, "heavy_params": heavy})
        make_console().print(f"wrote {path}")
    return 0


def show(rows: list[Any], best: Any, heavy: list[dict[str, Any]], inputs: dict[str, Any],
         budget: float | None) -> None:
    from rich.table import Table

    from poise.log import make_console

    console = make_console()
    c = inputs["cluster"]
    console.print(f"cluster: {c.num_nodes} nodes x {c.procs_per_node} workers = {c.world_size}; inter-node "
                  f"{c.inter.bandwidth_bytes_per_s * 8 / 1e9:g} Gbit/s per node, {c.inter.latency_s * 1e6:g} us; "
                  f"intra-node {c.intra.bandwidth_bytes_per_s / 1e9:g} GB/s per worker, {c.intra.latency_s * 1e6:g} us")
    console.print(f"one worker alone: {inputs['compute'].step_s:.4g} s per step")
    for what, source in inputs["sources"].items():
        console.print(f"  {what}: {source}")
    table = Table(title="predicted step per configuration (fastest first)")
    for header in ("codec", "collective", "bucket", "step", "exposed comm", "codec s", "sent/rank",
                   "over node link", "efficiency", "speed-up", "loss cost"):
        table.add_column(header, justify="right")
    for r in rows:
        table.add_row(r.codec, r.collective, f"{r.bucket_mb:g} MiB", f"{r.step_s:.4g} s", f"{r.exposed_comm_s:.3g} s",
                      f"{r.codec_s:.3g} s", format_size_bytes(int(r.wire_bytes)),
                      format_size_bytes(int(r.inter_node_bytes)) if r.inter_node_bytes else "-",
                      f"{r.efficiency:.1%}", f"{r.speedup:.1f}x",
                      "unknown" if r.loss_increase_pct is None else f"{r.loss_increase_pct:+.2f}%")
    console.print(table)
    limit = "any loss" if budget is None else f"loss within +{budget:g}%"
    if best is None:
        console.print(f"recommended ({limit}): nothing: no codec with a known accuracy cost fits the budget")
    else:
        console.print(f"recommended ({limit}): --codec {best.codec} --collective {best.collective} "
                      f"--bucket-mb {best.bucket_mb:g}: {best.step_s:.4g} s per step, {best.efficiency:.1%} efficiency")
    console.print("parameter blocks carrying the most gradient bytes:")
    for h in heavy:
        console.print(f"  {h['name']} {tuple(h['shape'])}: {format_size_bytes(h['bytes'])}, {h['share']:.1%} "
                      f"({h['kind']}): {h['advice']}")
