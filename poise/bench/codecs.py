"""``poise bench codecs``: codec kernel speed against memcpy, and what each codec does to training.

1. Kernel throughput: encode + decode of one float32 gradient (100 MB by default) per codec,
   in GB/s of gradient, next to a plain copy into a preallocated buffer (``dst.copy_(src)``)
   of the same tensor measured in the same run, interleaved with the codec's repeats so both
   see the same machine. Medians of the repeats after warm-up. Codecs reuse their buffers
   (``key=0``), as they do under DDP from the second step on.
2. Accuracy (``--accuracy``, on by default): one real ``poise train`` job per codec on the
   digits task; final eval accuracy and loss, communication share of the step, median step,
   and the compression ratio from the hook's byte counters.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.comm import codecs

HELP = "codec encode+decode speed vs memcpy; accuracy and bytes of training with each codec"


@dataclass(frozen=True)
class KernelCase:
    """One row of the kernel table: a codec with options, and the share of memcpy speed it should reach."""

    label: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    target: float | None = None  # encode+decode speed as a fraction of memcpy's
    max_repeats: int | None = None  # slow reference kernels: fewer repeats


KERNEL_CASES = (
    KernelCase("fp16", "fp16", target=0.5),
    KernelCase("bf16", "bf16", target=0.5),
    KernelCase("int8", "int8", target=0.5),
    KernelCase("sign", "sign", target=0.5),
    KernelCase("topk", "topk", {"ratio": 0.01}, target=0.25),
    KernelCase("topk-exact", "topk", {"ratio": 0.01, "exact": True}, max_repeats=3),
    KernelCase("randomk", "randomk", {"ratio": 0.01}),
    KernelCase("powersgd", "powersgd", {"rank": 4}),
)

# codecs compared in training runs (table 2): the config names, "none" first as the reference
ACCURACY_CODECS = ("none", "fp16", "bf16", "int8", "sign", "topk", "randomk", "powersgd", "torch-fp16",
                   "torch-powersgd")


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_kernel(case: KernelCase, x: torch.Tensor, copy_dst: torch.Tensor, repeats: int,
                   warmup: int) -> dict[str, Any]:
    """Median encode, decode and memcpy seconds for ``case`` on ``x``, and the derived rates."""
    codec = codecs.make(case.name, **case.options)
    out = torch.empty_like(x)
    repeats = min(repeats, case.max_repeats or repeats)
    encode_s, decode_s, copy_s = [], [], []
    encoded = None
    for i in range(warmup + repeats):
        t_copy = _seconds(lambda: copy_dst.copy_(x))
        start = time.perf_counter()
        encoded = codec.encode(x, key=0)
        t_encode = time.perf_counter() - start
        t_decode = _seconds(lambda enc=encoded: codec.decode(enc, out=out))
        if i >= warmup:
            copy_s.append(t_copy)
            encode_s.append(t_encode)
            decode_s.append(t_decode)
    nbytes = x.numel() * x.element_size()
    codec_s = statistics.median(e + d for e, d in zip(encode_s, decode_s, strict=True))
    memcpy_s = statistics.median(copy_s)
    assert encoded is not None
    return {
        "codec": case.label,
        "options": case.options,
        "encode_ms": statistics.median(encode_s) * 1e3,
        "decode_ms": statistics.median(decode_s) * 1e3,
        "codec_gb_per_s": nbytes / codec_s / 1e9,
        "memcpy_gb_per_s": nbytes / memcpy_s / 1e9,
        "vs_memcpy": memcpy_s / codec_s,
        "target_vs_memcpy": case.target,
        "meets_target": None if case.target is None else memcpy_s / codec_s >= case.target,
        "compression_ratio": nbytes / codec.nbytes(encoded),
        "repeats": repeats,
    }


def kernel_table(mbytes: float, repeats: int, warmup: int, labels: list[str]) -> list[dict[str, Any]]:
    """Table 1 rows, one per kernel case in ``labels``."""
    x = torch.randn(int(mbytes * 1e6) // 4, generator=torch.Generator().manual_seed(0))
    copy_dst = torch.empty_like(x)
    return [measure_kernel(c, x, copy_dst, repeats, warmup) for c in KERNEL_CASES if c.label in labels]


def accuracy_table(out_dir: Any, names: list[str], train_args: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """Table 2 rows: one ``poise train`` job per codec name; figures from its report.json."""
    rows = []
    for name in names:
        report = run_train_job(name, out_dir, [*train_args, "--comm.codec", name], timeout_s)
        rows.append({
            "codec": name,
            **{k: report[k] for k in ("eval_accuracy", "eval_loss", "loss_unit", "comm_fraction", "median_step_s",
                                      "compression_ratio", "codec_s_per_step")},
            # seconds per step blocked in communication, mean over ranks of their medians
            "comm_wait_s": sum(r["median_comm_wait_s"] for r in report["per_rank"]) / len(report["per_rank"]),
        })
    base = next((r for r in rows if r["codec"] == "none"), None)
    for row in rows:
        if base is not None:
            row["accuracy_delta"] = row["eval_accuracy"] - base["eval_accuracy"]
            row["loss_delta_pct"] = 100 * (row["eval_loss"] / base["eval_loss"] - 1)
            row["comm_wait_vs_none"] = row["comm_wait_s"] / base["comm_wait_s"] if base["comm_wait_s"] else None
    return rows


def _names(text: str, allowed: list[str], flag: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag}={text!r}: unknown {', '.join(unknown) or '(empty)'}; "
                         f"allowed are {', '.join(allowed)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    labels = [c.label for c in KERNEL_CASES]
    parser.add_argument("--mbytes", type=float, default=100.0, help="gradient size for the kernel table, MB")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per kernel (medians)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
    parser.add_argument("--kernels", default=",".join(labels),
                        help=f"kernel rows: {', '.join(labels)} ('' skips the kernel table)")
    parser.add_argument("--accuracy", action=argparse.BooleanOptionalAction, default=True,
                        help="also train once per codec (table 2)")
    parser.add_argument("--codecs", default=",".join(ACCURACY_CODECS), help="codecs for the training runs")
    parser.add_argument("--task", default="digits", help="task for the training runs")
    parser.add_argument("--steps", type=int, default=300, help="steps per training run")
    parser.add_argument("--nproc", type=int, default=2, help="workers per training run")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per training run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-codecs-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "mbytes", "repeats", "steps", "nproc", "timeout_s")
    labels = _names(args.kernels, [c.label for c in KERNEL_CASES], "--kernels") if args.kernels else []
    names = _names(args.codecs, list(ACCURACY_CODECS), "--codecs") if args.accuracy else []
    out = output_dir(args.out, "codecs")
    kernels = kernel_table(args.mbytes, args.repeats, max(0, args.warmup), labels)
    if kernels:
        show_table(
            f"poise bench codecs: encode+decode of a {args.mbytes:g} MB float32 gradient, "
            f"{torch.get_num_threads()} threads, medians of {args.repeats}",
            kernels,
            [
                ("codec", "codec", str),
                ("encode_ms", "encode", lambda v: f"{v:.1f} ms"),
                ("decode_ms", "decode", lambda v: f"{v:.1f} ms"),
                ("codec_gb_per_s", "enc+dec", lambda v: f"{v:.2f} GB/s"),
                ("memcpy_gb_per_s", "memcpy", lambda v: f"{v:.2f} GB/s"),
                ("vs_memcpy", "vs memcpy", lambda v: f"{v:.2f}x"),
                ("target_vs_memcpy", "target", lambda v: "-" if v is None else f">= {v:.2f}x"),
                ("compression_ratio", "compression", lambda v: f"{v:.1f}x"),
            ],
        )
    results: dict[str, Any] = {"mbytes": args.mbytes, "repeats": args.repeats, "warmup": args.warmup,
                               "threads": torch.get_num_threads(), "kernels": kernels}
    if names:
        train_args = ["--task", args.task, "--steps", str(args.steps), "--nproc", str(args.nproc), *args.train_args]
        rows = accuracy_table(out, names, train_args, args.timeout_s)
        show_table(
            f"poise bench codecs: {args.task}, {args.steps} steps, {args.nproc} workers",
            rows,
            [
                ("codec", "codec", str),
                ("eval_accuracy", "eval acc", lambda v: f"{v:.2%}"),
                ("accuracy_delta", "vs none", lambda v: f"{v * 100:+.2f} pt"),
                ("eval_loss", "eval loss", lambda v: f"{v:.4f}"),
                ("loss_delta_pct", "loss vs none", lambda v: f"{v:+.2f}%"),
                ("compression_ratio", "compression", lambda v: f"{v:.1f}x"),
                ("comm_fraction", "comm", lambda v: f"{v:.1%}"),
                ("comm_wait_s", "comm wait", lambda v: f"{v * 1e3:.1f} ms"),
                ("comm_wait_vs_none", "vs none", lambda v: "-" if v is None else f"{v:.2f}x"),
                ("median_step_s", "median step", lambda v: f"{v * 1e3:.0f} ms"),
            ],
        )
        results.update({"task": args.task, "steps": args.steps, "train_args": train_args, "runs": rows})
    save_results(out, "codecs", results)
    return 0
