"""``poise plan``: predicted step time of every codec × collective × bucket size on a cluster.

Parses the cluster, the model and its compute, hands the numbers to the pure planner
(``poise/plan/``), prints the table, the recommendation and the heavy parameter blocks, and
with ``--json`` writes ``plan.json``. Every figure says whether it was measured or assumed.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from poise.units import format_size_bytes, parse_duration_s, parse_rate_bit_per_s

if TYPE_CHECKING:
    from poise.plan.costs import Link
    from poise.plan.step_time import CodecSpeed

T = TypeVar("T")

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


# Bounds of what the planner is asked about: wide enough for any real cluster and model, and
# narrow enough that every figure stays finite and the plan takes bounded time and memory.
MAX_NICS_PER_NODE = 64
MAX_BUCKET_SIZES = 16
MAX_BUCKET_MB = float(1 << 20)  # 1 TiB
MIN_RATE_BIT_PER_S, MAX_RATE_BIT_PER_S = 1e3, 1e16
MAX_LATENCY_S = 10.0
# flag dest -> (lowest, highest, whether the lowest itself is allowed)
_NUMBERS: dict[str, tuple[float, float, bool]] = {
    "step_s": (0.0, 1e6, True), "optimizer_s": (0.0, 1e6, True), "tokens_per_step": (0.0, 1e12, False),
    "peak_flops": (0.0, 1e21, False), "mfu": (0.0, 1.0, False), "max_loss_increase": (-100.0, 1e6, True),
}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse any flag out of its range before anything is computed (one-line ValueError naming it).

    The cluster's ranks are bounded by :data:`poise.plan.costs.MAX_WORLD_SIZE`: the tree
    collective's crossing pattern is computed over every rank, so 10^9 nodes would need tens of
    GB. Numbers must be finite: ``--step-s nan`` would predict every step as 0 s.
    """
    from poise.plan.costs import MAX_WORLD_SIZE
    from poise.plan.model import MAX_VOCAB_SIZE

    for flag, value, high in (("--nodes", args.nodes, MAX_WORLD_SIZE), ("--procs-per-node", args.procs_per_node,
                              MAX_WORLD_SIZE), ("--nics-per-node", args.nics_per_node, MAX_NICS_PER_NODE),
                              ("--vocab-size", args.vocab_size, MAX_VOCAB_SIZE)):
        if not 1 <= value <= high:
            raise ValueError(f"{flag}={value} is invalid: allowed is 1 to {high}")
    if args.nodes * args.procs_per_node > MAX_WORLD_SIZE:
        raise ValueError(f"--nodes={args.nodes} x --procs-per-node={args.procs_per_node} is "
                         f"{args.nodes * args.procs_per_node} ranks: the planner models at most {MAX_WORLD_SIZE}")
    for name, (low, high, low_allowed) in _NUMBERS.items():
        value = getattr(args, name)
        if value is None:
            continue
        if not (low <= value <= high and (low_allowed or value > low)):
            interval = f"{'[' if low_allowed else '('}{low:g}, {high:g}]"
            raise ValueError(f"--{name.replace('_', '-')}={value!r} is invalid: allowed is a number in {interval}")
    if args.top < 0:
        raise ValueError(f"--top={args.top} is invalid: give the rows to print, 0 for all")
    out = Path(args.out)
    if args.json and (out.exists() or out.is_symlink()) and not out.is_dir():
        raise ValueError(f"--out {args.out!r} is not a directory: give the directory to write plan.json into")


def _bucket_sizes(text: str) -> list[float]:
    """``--bucket-mb``: 1 to MAX_BUCKET_SIZES sizes in MiB, each in (0, MAX_BUCKET_MB]."""
    parts = [v.strip() for v in text.split(",") if v.strip()]
    try:
        buckets = [float(v) for v in parts[: MAX_BUCKET_SIZES + 1]]
    except ValueError:
        buckets = []
    if not buckets or len(parts) > MAX_BUCKET_SIZES or not all(0 < b <= MAX_BUCKET_MB for b in buckets):
        raise ValueError(f"--bucket-mb={text[:80]!r} is invalid: give 1 to {MAX_BUCKET_SIZES} sizes in MiB, each "
                         f"above 0 and at most {MAX_BUCKET_MB:g}, separated by commas")
    return buckets


def _rate_bytes_per_s(text: str, flag: str) -> float:
    """A rate flag in bytes per second, within MIN/MAX_RATE_BIT_PER_S."""
    rate = parse_rate_bit_per_s(text, what=flag)
    if not MIN_RATE_BIT_PER_S <= rate <= MAX_RATE_BIT_PER_S:
        raise ValueError(f"{flag} {text[:80]!r} is invalid: allowed is {MIN_RATE_BIT_PER_S:g} to "
                         f"{MAX_RATE_BIT_PER_S:g} bit/s")
    return rate / 8


def _latency_s(text: str, flag: str) -> float:
    """A latency flag in seconds, at most MAX_LATENCY_S."""
    latency = parse_duration_s(text, what=flag)
    if not 0 <= latency <= MAX_LATENCY_S:
        raise ValueError(f"{flag} {text[:80]!r} is invalid: allowed is 0 to {MAX_LATENCY_S:g} s")
    return latency


def _names(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    if not text:
        return allowed
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{flag}={text!r}: unknown {', '.join(bad) or '(empty)'}; allowed are {', '.join(allowed)}")
    return names


# What a measurement file may hold for the planner to read it in bounded time: the busbw fit is
# O(n^2 log n) in its points, and each profiled layer is a tensor every configuration plans.
MAX_POINTS = 1024
MAX_ROWS = 10_000
MAX_LAYERS = 4096


def _read_json(path: str, flag: str) -> dict[str, Any]:
    """The JSON object in ``path`` (bounded in size and depth; NaN and Infinity refused)."""
    from poise.diagnostics.jsonfile import read_json_object

    try:
        return read_json_object(path, allow_nan=False)
    except FileNotFoundError:
        raise ValueError(f"{flag} {path!r} cannot be read: no such file") from None
    except ValueError as exc:
        raise ValueError(f"{flag} {exc}") from None


def _parsed(flag: str, path: str, what: str, parse: Callable[[dict[str, Any]], T]) -> T:
    """``parse`` of the JSON object in ``path``; whatever in the file does not have the shape
    ``parse`` reads (a key missing, a string for a number, a list too long) is one line
    naming the flag and the file. A file is input: any of these exceptions means a file of
    another kind, or one edited by hand."""
    data = _read_json(path, flag)
    try:
        return parse(data)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, ZeroDivisionError, OverflowError) as exc:
        detail = str(exc)[:160] if isinstance(exc, ValueError) else f"{type(exc).__name__} {str(exc)[:120]}"
        raise ValueError(f"{flag} {path!r} is not {what}: {detail}") from None


def _count(values: Any, what: str, most: int) -> list[Any]:
    if not isinstance(values, list) or not 1 <= len(values) <= most:
        raise ValueError(f"{what} must be a list of 1 to {most} entries")
    return values


def _busbw_link(data: dict[str, Any]) -> Link:
    """The inter-node link fitted to a busbw.json's all-reduce times."""
    from poise.plan import calibrate
    from poise.plan.costs import MAX_WORLD_SIZE

    world = data["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or not 2 <= world <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size {str(world)[:20]} is not a whole number of 2 to {MAX_WORLD_SIZE} ranks")
    _count(data["results"], "results", MAX_ROWS)
    points = calibrate.busbw_points(data)
    if len(points) > MAX_POINTS or not all(s > 0 and t > 0 for s, t in points):
        raise ValueError(f"its all-reduce needs 2 to {MAX_POINTS} points of positive sizes and seconds")
    return calibrate.fit_ring_link(points, world)


def _profile(report: dict[str, Any]) -> dict[str, Any]:
    """A report.json's layer profile, its four columns checked: names, and finite seconds and bytes >= 0."""
    profile = report.get("profile")
    if not isinstance(profile, dict):
        raise ValueError("it holds no layer profile (run poise pipeline)")
    columns = {k: _count(profile[k], k, MAX_LAYERS) for k in ("names", "param_bytes", "time_s", "forward_s")}
    if len({len(c) for c in columns.values()}) != 1:
        raise ValueError("its profile's names, param_bytes, time_s and forward_s differ in length")
    if not all(isinstance(n, str) for n in columns["names"]):
        raise ValueError("its profile's names must be strings")
    for key in ("param_bytes", "time_s", "forward_s"):
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e18 for v in columns[key]):
            raise ValueError(f"its profile's {key} must be numbers >= 0")
    return profile


def _kernel_speeds(data: dict[str, Any]) -> dict[str, CodecSpeed]:
    from poise.plan import calibrate

    mbytes = float(data["mbytes"])
    if not 0 < mbytes <= 1e9:
        raise ValueError(f"mbytes {mbytes:g} is outside (0, 1e9]")
    return calibrate.codec_speeds_from_kernels(_count(data["kernels"], "its kernel table", MAX_ROWS), mbytes)


def _loss_costs(data: dict[str, Any]) -> dict[str, float]:
    from poise.plan import planner

    runs = _count(data.get("runs"), "runs (a codecs.json of poise bench codecs with training runs)", MAX_ROWS)
    if not any(isinstance(r, dict) and "loss_delta_pct" in r for r in runs):
        raise ValueError("none of its runs has a loss_delta_pct")
    return planner.loss_costs_from_results(data)


def _check_finite(inputs: dict[str, Any]) -> None:
    """Every figure read or derived is finite and >= 0 (a measurement file's 1e308 would
    otherwise turn into inf or nan seconds in every row)."""
    c = inputs["cluster"]
    figures = {"inter-node latency": c.inter.latency_s, "inter-node rate": c.inter.bandwidth_bytes_per_s,
               "intra-node latency": c.intra.latency_s, "intra-node rate": c.intra.bandwidth_bytes_per_s,
               **{f"compute {k}": v for k, v in vars(inputs["compute"]).items() if isinstance(v, float)},
               **{f"{name} encode": s.encode_s_per_byte for name, s in inputs["speeds"].items()},
               **{f"{name} decode": s.decode_s_per_byte for name, s in inputs["speeds"].items()},
               **{f"{name} loss cost": v for name, v in (inputs["costs"] or {}).items()}}
    for what, value in figures.items():
        if not math.isfinite(value) or (value < 0 and not what.endswith("loss cost")):
            raise ValueError(f"the {what} is {value:g}: the inputs (files, flags) give no usable figure")


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the planner needs from ``args``, with where each part came from."""
    from poise.plan import calibrate, planner
    from poise.plan.costs import Cluster, Link
    from poise.plan.model import transformer_params

    check_arguments(args)
    sources: dict[str, str] = {}
    if args.busbw:
        inter = _parsed("--busbw", args.busbw, "a busbw.json of poise diagnose busbw", _busbw_link)
        sources["inter-node link"] = f"measured: ring fit of {args.busbw}'s all-reduce"
    elif args.link:
        rate = _rate_bytes_per_s(args.link, "--link") * args.nics_per_node
        inter = Link(_latency_s(args.latency, "--latency"), rate)
        sources["inter-node link"] = (f"given: {args.nics_per_node} x {args.link} per node; latency {args.latency} "
                                      "(assumed)")
    elif args.nodes > 1:
        raise ValueError("--link RATE (or --busbw JSON) is needed with more than one node")
    else:
        inter = Link(0.0, 1e30)
    if args.intra:
        intra = Link(_latency_s(args.intra_latency, "--intra-latency"), _rate_bytes_per_s(args.intra, "--intra"))
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
        profile = _parsed("--profile", str(Path(args.profile) / "report.json"), "a report.json of poise pipeline",
                          _profile)
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
        speeds = _parsed("--codec-speeds", args.codec_speeds, "a codecs.json of poise bench codecs with a kernel "
                         "table", _kernel_speeds)
        sources["codec speeds"] = f"measured: {args.codec_speeds} kernel table (without error feedback)"
    else:
        speeds = planner.assumed_speeds(_rate_bytes_per_s(args.mem_bw, "--mem-bw"))
        sources["codec speeds"] = f"assumed: memory passes per codec at {args.mem_bw}"
    costs = None
    if args.codec_results:
        costs = _parsed("--codec-results", args.codec_results, "a codecs.json of poise bench codecs", _loss_costs)
        sources["accuracy cost"] = f"measured: {args.codec_results} (eval loss vs none)"
    else:
        sources["accuracy cost"] = "unknown (no --codec-results): none is 0 by definition"
    inputs = {"cluster": cluster, "params": params, "compute": compute, "speeds": speeds, "costs": costs,
              "sources": sources, "buckets": _bucket_sizes(args.bucket_mb),
              "codecs": _names(args.codecs, tuple(planner.CODEC_OPTIONS), "--codecs"),
              "collectives": _names(args.collectives, planner.COLLECTIVES, "--collectives")}
    _check_finite(inputs)
    return inputs


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
        try:
            path = write_json_atomic(Path(args.out) / "plan.json", {
                "cluster": {"num_nodes": c.num_nodes, "procs_per_node": c.procs_per_node,
                            "intra": vars(c.intra), "inter": vars(c.inter)},
                "compute": vars(inputs["compute"]), "sources": inputs["sources"],
                "max_loss_increase_pct": args.max_loss_increase, "rows": [r.as_dict() for r in rows],
                "recommended": best.as_dict() if best else None, "heavy_params": heavy})
        except OSError as exc:  # a read-only or full file system, a file in the way of --out's parents
            raise ValueError(f"--out {args.out!r}: plan.json cannot be written ({exc.strerror or exc})") from None
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
