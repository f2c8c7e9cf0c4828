"""``poise bench codecs``: codec kernel speed against memcpy, and what each codec does to training.

1. Kernel throughput: encode + decode of one float32 gradient (100 MB by default) per codec,
   in GB/s of gradient, next to a plain copy into a preallocated buffer (``dst.copy_(src)``)
   of the same tensor measured in the same run, interleaved with the codec's repeats so both
   see the same machine. Medians of the repeats after warm-up. Codecs reuse their buffers
   (``key=0``), as they do under DDP from the second step on.
2. Accuracy (``--accuracy``, on by default): real ``poise train`` jobs per codec (digits by
   default, ``--task code-lm``), ``--seeds`` of them each; mean eval accuracy and loss, their
   differences from ``none`` paired by seed (± standard error), whether the codec issue's
   target is met (digits: within 0.3 pt accuracy; code-lm: within 2 % bits per byte),
   communication share of the step, median step, and the compression ratio from the hook's
   byte counters. A codec spec may set the codec's option: ``topk:ratio=0.1``,
   ``powersgd:rank=8``, so the table can show where a codec meets its target. The row
   ``alone`` is one worker on its own (same per-rank batch and steps, nothing sent): a codec
   below it loses more by compressing than data parallelism gains.
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
# a second reference: one worker with the same per-rank batch and steps, no communication at all.
# A codec that trains worse than this sends gradients that are worth less than not sending any.
ALONE = "alone"


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


# codec options a spec may set ("topk:ratio=0.1"), and the poise train flag each one maps to
SPEC_OPTIONS = {"ratio": "--comm.topk_ratio", "rank": "--comm.powersgd_rank", "chunk_size": "--comm.int8_chunk_size",
                "local_first": "--comm.local_first"}
# the codec issue's accuracy targets, per task: (figure, bound) with the delta against "none"
TARGETS: dict[str, tuple[str, float]] = {"digits": ("accuracy_delta", -0.003), "code-lm": ("loss_delta_pct", 2.0)}


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``"topk:ratio=0.1"`` -> ``("topk", ["--comm.topk_ratio", "0.1"])`` (options separated
    by ``:``); a one-line ValueError for an unknown codec or option."""
    name, *options = spec.split(":")
    if name == ALONE and not options:
        return "none", ["--nproc", "1"]  # the last --nproc wins
    if name not in ACCURACY_CODECS:
        raise ValueError(f"--codecs: {name!r} is unknown; allowed are {', '.join((*ACCURACY_CODECS, ALONE))}")
    flags: list[str] = []
    for item in options:
        key, _, value = item.partition("=")
        if key not in SPEC_OPTIONS or not value:
            raise ValueError(f"--codecs: option {item!r} of {spec!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(SPEC_OPTIONS)}")
        flags += [SPEC_OPTIONS[key], value]
    return name, flags


def accuracy_table(out_dir: Any, specs: list[str], train_args: list[str], timeout_s: float,
                   seeds: int = 1, task: str = "") -> list[dict[str, Any]]:
    """Table 2 rows: ``poise train`` jobs per codec spec and seed; figures from their report.json.

    Accuracy and loss are means over ``seeds`` (seeds 0..n-1: initial weights and data order).
    The deltas against ``none`` are paired: each seed's run against ``none`` with the same seed,
    then averaged, with the standard error of that mean (a digits test set of 360 images
    moves by 0.28 pt per image, about the size of the effects measured).
    """
    rows = []
    for spec in specs:
        name, flags = parse_spec(spec)
        reports = []
        for seed in range(seeds):
            label = spec.replace(":", "-").replace("=", "") + (f"-seed{seed}" if seeds > 1 else "")
            args = [*train_args, "--comm.codec", name, *flags, *(["--train.seed", str(seed)] if seeds > 1 else [])]
            reports.append(run_train_job(label, out_dir, args, timeout_s))
        rows.append({
            "codec": spec,
            **{k: statistics.fmean(r[k] for r in reports)
               for k in ("eval_accuracy", "eval_loss", "comm_fraction", "median_step_s", "compression_ratio",
                         "codec_s_per_step")},
            "loss_unit": reports[0]["loss_unit"],
            "seed_accuracy": [r["eval_accuracy"] for r in reports],
            "seed_loss": [r["eval_loss"] for r in reports],
            # seconds per step blocked in communication, mean over ranks of their medians
            "comm_wait_s": statistics.fmean(
                sum(rr["median_comm_wait_s"] for rr in r["per_rank"]) / len(r["per_rank"]) for r in reports),
        })
    base = next((r for r in rows if r["codec"] == "none"), None)
    target = TARGETS.get(task)
    for row in rows:
        if base is None:
            continue
        acc = [a - b for a, b in zip(row["seed_accuracy"], base["seed_accuracy"], strict=True)]
        loss = [100 * (a / b - 1) for a, b in zip(row["seed_loss"], base["seed_loss"], strict=True)]
        row["accuracy_delta"], row["accuracy_delta_se"] = _mean_se(acc)
        row["loss_delta_pct"], row["loss_delta_pct_se"] = _mean_se(loss)
        row["comm_wait_vs_none"] = row["comm_wait_s"] / base["comm_wait_s"] if base["comm_wait_s"] else None
        if target is not None and row["codec"] != ALONE:
            figure, bound = target
            row["target"] = f"{figure} {'>=' if bound < 0 else '<='} {bound:g}"
            row["meets_target"] = row[figure] >= bound if bound < 0 else row[figure] <= bound
    return rows


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None


def _pm(mean: float, se: float | None, fmt: str, scale: float = 1.0) -> str:
    text = format(mean * scale, fmt)
    return text if se is None else f"{text} ± {format(se * scale, fmt.lstrip('+'))}"


def _specs(text: str) -> list[str]:
    """The ``--codecs`` specs, each checked before anything runs."""
    specs = [t.strip() for t in text.split(",") if t.strip()]
    if not specs:
        raise ValueError(f"--codecs={text!r} names no codec; allowed are {', '.join(ACCURACY_CODECS)}")
    for spec in specs:
        parse_spec(spec)
    return specs


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
    parser.add_argument("--codecs", default=",".join((*ACCURACY_CODECS, ALONE)),
                        help="codecs for the training runs, each NAME or NAME:KEY=VALUE with KEY one of "
                             f"{', '.join(SPEC_OPTIONS)} (e.g. topk:ratio=0.1); '{ALONE}': one worker, "
                             "no communication, for reference")
    parser.add_argument("--seeds", type=int, default=1,
                        help="training runs per codec (seeds 0..N-1); figures are means, deltas paired by seed")
    parser.add_argument("--task", default="digits", help="task for the training runs")
    parser.add_argument("--steps", type=int, default=300, help="steps per training run")
    parser.add_argument("--nproc", type=int, default=2, help="workers per training run")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per training run, seconds")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-codecs-<timestamp>)")
    parser.add_argument("train_args", nargs="*", help="extra 'poise train' flags, after --")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "mbytes", "repeats", "steps", "nproc", "timeout_s", "seeds")
    labels = _names(args.kernels, [c.label for c in KERNEL_CASES], "--kernels") if args.kernels else []
    specs = _specs(args.codecs) if args.accuracy else []
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
    if specs:
        train_args = ["--task", args.task, "--steps", str(args.steps), "--nproc", str(args.nproc), *args.train_args]
        rows = accuracy_table(out, specs, train_args, args.timeout_s, args.seeds, args.task)
        shown = [{**row, **({  # "mean ± standard error" cells
            "accuracy_delta_text": _pm(row["accuracy_delta"], row["accuracy_delta_se"], "+.2f", 100) + " pt",
            "loss_delta_text": _pm(row["loss_delta_pct"], row["loss_delta_pct_se"], "+.2f") + "%",
        } if "accuracy_delta" in row else {})} for row in rows]
        seeds = f", mean of {args.seeds} seeds" if args.seeds > 1 else ""
        show_table(
            f"poise bench codecs: {args.task}, {args.steps} steps, {args.nproc} workers{seeds}",
            shown,
            [
                ("codec", "codec", str),
                ("eval_accuracy", "eval acc", lambda v: f"{v:.2%}"),
                ("accuracy_delta_text", "vs none", str),
                ("eval_loss", "eval loss", lambda v: f"{v:.4f}"),
                ("loss_delta_text", "loss vs none", str),
                ("meets_target", "target", lambda v: "met" if v else "missed"),
                ("compression_ratio", "compression", lambda v: f"{v:.1f}x"),
                ("comm_fraction", "comm", lambda v: f"{v:.1%}"),
                ("comm_wait_s", "comm wait", lambda v: f"{v * 1e3:.1f} ms"),
                ("comm_wait_vs_none", "vs none", lambda v: "-" if v is None else f"{v:.2f}x"),
                ("median_step_s", "median step", lambda v: f"{v * 1e3:.0f} ms"),
            ],
        )
        results.update({"task": args.task, "steps": args.steps, "seeds": args.seeds, "train_args": train_args,
                        "target": TARGETS.get(args.task), "runs": rows})
    save_results(out, "codecs", results)
    return 0
