"""Bus bandwidth of the collectives on this job's network, with the nccl-tests conventions.

For each operation and message size: warm-up calls, then timed repeats. Before each repeat
the ranks meet (a one-element all-reduce, CUDA synchronized), each times its own call up to
completion (CUDA synchronized), and a repeat lasts as long as its slowest rank; the figure
is the median over repeats. With ``S`` the size in bytes and ``t`` that time in seconds:

- ``algbw = S / t`` (bytes/s). ``S`` is the whole buffer: the all-reduced or broadcast
  tensor, the gathered output of an all-gather, the scattered input of a reduce-scatter.
- ``busbw = algbw * factor``, the rate each rank's link must sustain, comparable across
  operations and world sizes ``n``: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter
  ``(n-1)/n``, broadcast 1 (nccl-tests, ``doc/PERFORMANCE.md``).

Operations: the backend's ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
and poise's all-reduce algorithms (``poise-flat``, ``poise-ring``, ``poise-tree``,
``poise-hierarchical``: ``poise/comm/collectives/``). Run with ``poise diagnose busbw``
(which starts the workers), or inside any torchrun job::

    torchrun --nproc-per-node 8 -m poise.diagnostics.busbw --max-bytes 1G --link 400gbit

Rank 0 prints the tables and writes ``busbw.json`` and ``busbw.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from poise.units import format_size_bytes, parse_rate_bit_per_s, parse_size_bytes

log = logging.getLogger(__name__)

HELP = "time, algbw and busbw of all-reduce, all-gather, reduce-scatter, broadcast and poise's algorithms"

# the *_single names are torch >= 2.10's; the older ones warn there
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
BACKEND_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
POISE_OPS = ("poise-flat", "poise-ring", "poise-tree", "poise-hierarchical")
OPS = BACKEND_OPS + POISE_OPS


@dataclass(frozen=True)
class Measurement:
    """One operation at one size.

    Attributes:
        op: operation name (see ``OPS``). requested_bytes: the size asked for. size_bytes: ``S``
            as defined in the module docstring (rounded to whole float32 entries per rank).
        time_s: median over repeats of the slowest rank's seconds. algbw / busbw: bytes/s.
        error: why the backend refused the operation ('' when it ran).
    """

    op: str
    requested_bytes: int
    size_bytes: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    error: str = ""


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw ratio for ``op`` on ``world_size`` ranks."""
    n = world_size
    if op == "broadcast":
        return 1.0
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 2 * (n - 1) / n  # every all-reduce


# What one measurement may ask of every rank: each allocates the largest size, and runs
# warmup + repeats calls per op and size.
MAX_SIZE_BYTES = 16 << 30
MAX_REPEATS = 10_000


def size_ladder(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (bytes)."""
    if min_bytes > max_bytes:
        raise ValueError(f"--min-bytes={min_bytes} is above --max-bytes={max_bytes}")
    if factor < 2:
        raise ValueError(f"--factor={factor} must be at least 2")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


# -- measuring (every rank) -------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU/GPU sync: the timed work has finished


def _prepare(op: str, size_bytes: int, world_size: int, device: torch.device,
             algorithms: dict[str, Any]) -> tuple[Callable[[], None], int]:
    """A call that runs ``op`` once to completion, and the size ``S`` it moves (bytes)."""
    rank = dist.get_rank()
    if op in ("all_gather", "reduce_scatter"):
        per_rank = max(1, size_bytes // (4 * world_size))
        small = torch.ones(per_rank, device=device)
        big = torch.ones(per_rank * world_size, device=device)
        if op == "all_gather":
            return lambda: _all_gather(big, small), big.numel() * 4
        return lambda: _reduce_scatter(small, big), big.numel() * 4
    x = torch.full((max(1, size_bytes // 4),), float(rank + 1), device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(x), x.numel() * 4
    if op == "broadcast":
        return lambda: dist.broadcast(x, src=0), x.numel() * 4
    algorithm = algorithms[op]
    return lambda: algorithm.all_reduce(x).wait(), x.numel() * 4


def measure(op: str, size_bytes: int, *, warmup: int, repeats: int, device: torch.device,
            algorithms: dict[str, Any]) -> Measurement:
    """Median seconds of ``op`` at ``size_bytes`` over ``repeats`` (slowest rank per repeat)."""
    n = dist.get_world_size()
    try:
        run, size = _prepare(op, size_bytes, n, device, algorithms)
        run()  # the backend refuses unsupported operations here, on every rank alike
    except RuntimeError as exc:
        return Measurement(op, size_bytes, size_bytes, math.nan, math.nan, math.nan, str(exc).splitlines()[0])
    meet = torch.zeros(1, device=device)
    for _ in range(warmup):
        run()
    times = torch.zeros(repeats, dtype=torch.float64, device=device)
    for i in range(repeats):
        dist.all_reduce(meet)
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    time_s = statistics.median(times.tolist())
    algbw = size / time_s
    return Measurement(op, size_bytes, size, time_s, algbw, algbw * bus_factor(op, n))


def measure_busbw(ops: Sequence[str], sizes_bytes: Sequence[int], *, warmup: int, repeats: int,
                  device: torch.device) -> list[Measurement]:
    """Every op at every size (a collective call: all ranks call it with the same arguments)."""
    from poise.comm import collectives

    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"--ops {','.join(unknown)} unknown: allowed are {', '.join(OPS)}")
    algorithms: dict[str, Any] = {}
    topology = None
    if any(op in POISE_OPS for op in ops):
        topology = collectives.Topology.discover()
        for op in ops:
            if op in POISE_OPS:
                algorithms[op] = collectives.make(op.removeprefix("poise-"), topology=topology)
    results = []
    try:
        for size in sizes_bytes:
            for op in ops:
                results.append(measure(op, size, warmup=warmup, repeats=repeats, device=device,
                                       algorithms=algorithms))
                log.debug("%s", results[-1])
    finally:
        if topology is not None:
            topology.close()
    return results


# -- reporting (rank 0) -------------------------------------------------------------------------


def best_by_op(results: Sequence[Measurement], link_bytes_per_s: float | None) -> list[dict[str, Any]]:
    """Per op: the best busbw (bytes/s), at which size, and its share of the line rate."""
    rows = []
    for op in dict.fromkeys(m.op for m in results):
        ran = [m for m in results if m.op == op and not m.error]
        if not ran:
            continue
        best = max(ran, key=lambda m: m.busbw_bytes_per_s)
        row = {"op": op, "busbw_bytes_per_s": best.busbw_bytes_per_s, "size_bytes": best.size_bytes}
        if link_bytes_per_s:
            row["line_rate_ratio"] = best.busbw_bytes_per_s / link_bytes_per_s
        rows.append(row)
    return rows


def show(results: Sequence[Measurement], world_size: int, link_bytes_per_s: float | None) -> None:
    """Print time and busbw per size and op, and the best busbw per op."""
    from rich.table import Table

    from poise.log import make_console

    console = make_console()
    ops = list(dict.fromkeys(m.op for m in results))
    sizes = list(dict.fromkeys(m.requested_bytes for m in results))
    by_key = {(m.op, m.requested_bytes): m for m in results}
    for title, fmt in (("busbw, GB/s", lambda m: f"{m.busbw_bytes_per_s / 1e9:.3f}"),
                       ("time, ms (median, slowest rank)", lambda m: f"{m.time_s * 1e3:.3f}")):
        table = Table(title=f"{title} — {world_size} ranks")
        table.add_column("size", justify="right")
        for op in ops:
            table.add_column(op, justify="right")
        for size in sizes:
            cells = []
            for op in ops:
                m = by_key.get((op, size))
                cells.append("-" if m is None or m.error else fmt(m))
            table.add_row(format_size_bytes(size), *cells)
        console.print(table)
    summary = Table(title="best busbw per operation" + (" vs line rate" if link_bytes_per_s else ""))
    for header in ("op", "best busbw GB/s", "at size") + (("of line rate",) if link_bytes_per_s else ()):
        summary.add_column(header, justify="right")
    for row in best_by_op(results, link_bytes_per_s):
        cells = [row["op"], f"{row['busbw_bytes_per_s'] / 1e9:.3f}", format_size_bytes(row["size_bytes"])]
        if link_bytes_per_s:
            cells.append(f"{row['line_rate_ratio']:.2f}")
        summary.add_row(*cells)
    console.print(summary)
    for m in results:
        if m.error:
            console.print(f"{m.op}: not supported here ({m.error})")
            break


def plot(results: Sequence[Measurement], path: Path, world_size: int, link_bytes_per_s: float | None) -> Path:
    """busbw against size (log-log), one line per op, the line rate dashed; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from poise.files import write_atomic

    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(m.op for m in results):
        ran = [m for m in results if m.op == op and not m.error]
        if ran:
            ax.plot([m.size_bytes for m in ran], [m.busbw_bytes_per_s / 1e9 for m in ran], marker="o", label=op)
    if link_bytes_per_s:
        ax.axhline(link_bytes_per_s / 1e9, linestyle="--", color="black", label="line rate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size, bytes")
    ax.set_ylabel("busbw, GB/s")
    ax.set_title(f"bus bandwidth, {world_size} ranks")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    write_atomic(path, lambda handle: fig.savefig(handle, format="png", dpi=100))
    plt.close(fig)
    return path


# -- command line (workers) ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The measurement options, shared by ``poise diagnose busbw`` and this module's ``main``."""
    parser.add_argument("--min-bytes", default="4K", help="smallest size (4096, 4K, 1M...), default 4K")
    parser.add_argument("--max-bytes", default="256M", help="largest size, default 256M")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows, default 4")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per op and size, default 2")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per op and size (median), default 5")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--link", default="", metavar="RATE",
                        help="line rate of the slowest link (1gbit, 100mbit, 25GB/s): adds busbw / line rate")
    parser.add_argument("--backend", default="auto", help="process-group backend: auto, gloo, nccl")
    parser.add_argument("--out", default="", help="output directory (default runs/busbw-<timestamp>)")


def forwarded_argv(args: argparse.Namespace) -> list[str]:
    """The measurement options of ``args`` as command-line arguments (for the workers)."""
    out = []
    for name in ("min_bytes", "max_bytes", "factor", "warmup", "repeats", "ops", "link", "backend", "out"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


def check_arguments(args: argparse.Namespace) -> tuple[list[int], list[str], float | None]:
    """Sizes (bytes), ops and line rate (bytes/s) from ``args``; one-line ValueError if bad."""
    for name in ("warmup", "repeats"):
        value, low = getattr(args, name), 1 if name == "repeats" else 0
        if not low <= value <= MAX_REPEATS:
            raise ValueError(f"--{name}={value} is invalid: allowed is {low} to {MAX_REPEATS}")
    max_bytes = parse_size_bytes(args.max_bytes)
    if max_bytes > MAX_SIZE_BYTES:  # every rank allocates the size (all_gather: world_size times its part)
        raise ValueError(f"--max-bytes={args.max_bytes!r} is invalid: allowed is at most {MAX_SIZE_BYTES >> 30}G")
    sizes = size_ladder(parse_size_bytes(args.min_bytes), max_bytes, args.factor)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ValueError(f"--ops={args.ops!r}: allowed are {', '.join(OPS)}")
    # busbw is in bytes/s (the nccl-tests convention), the link rate in bits/s
    link_bytes_per_s = parse_rate_bit_per_s(args.link, what="link rate") / 8 if args.link else None
    return sizes, ops, link_bytes_per_s


def default_out_dir() -> str:
    return str(Path("runs") / time.strftime("busbw-%Y%m%d-%H%M%S"))


def main(argv: list[str] | None = None) -> int:
    """Worker entry point (under torchrun): measure, and on rank 0 print and write the results."""
    from poise.config import DistConfig
    from poise.files import write_json_atomic
    from poise.log import setup_logging
    from poise.runtime import dist as rdist
    from poise.runtime.launcher import become_worker

    parser = argparse.ArgumentParser(prog="poise.diagnostics.busbw", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    sizes, ops, link = check_arguments(args)
    become_worker()
    setup_logging(int(os.environ.get("RANK", "0")))
    ctx = rdist.init_from_env(DistConfig(backend=args.backend, timeout_s=600.0))
    try:
        results = measure_busbw(ops, sizes, warmup=args.warmup, repeats=args.repeats, device=ctx.device)
    except BaseException:
        rdist.close(synchronize=False)
        raise
    rdist.close(synchronize=True)
    if ctx.is_main:
        out = Path(args.out or default_out_dir())
        show(results, ctx.world_size, link)
        data = {"world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
                "local_world_size": ctx.local_world_size, "warmup": args.warmup, "repeats": args.repeats,
                "link_bytes_per_s": link, "results": [asdict(m) for m in results],
                "best": best_by_op(results, link)}
        write_json_atomic(out / "busbw.json", data)
        plot(results, out / "busbw.png", ctx.world_size, link)
        log.info("wrote %s and %s", out / "busbw.json", out / "busbw.png")
    return 0


if __name__ == "__main__":
    from poise.runtime import dist as rdist

    rdist.exit_process(main())
