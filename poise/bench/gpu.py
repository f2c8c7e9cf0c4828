"""The prepared GPU check (``make gpu-check``): poise's CUDA tests and a short GPU bench, one JSON.

Why: poise's users train on GPUs with NCCL, and a device is lent to a session only now and
then, for about 15 minutes all tries together. Everything a lent machine should run is
therefore prepared here, as one command that finishes in under 8 minutes on one H100 (so that
a rerun fits) and prints its progress:

1. the ``cuda`` tests (``pytest -m cuda`` over ``tests/cuda/`` and ``tests/*/test_*_cuda.py``):
   the codecs on CUDA against their CPU reference, the probe's CUDA events, sessions on NCCL
   and on gloo with CUDA tensors, PowerSGD's thread with streams, checkpoints of CUDA state,
   the freed-memory policy left alone on a GPU, Lightning's strategy on ``accelerator="gpu"``;
2. the codec kernels' encode + decode throughput against the device's own copy bandwidth
   (``dst.copy_(src)`` of the same tensor, interleaved; GB/s of gradient, i.e. tensor bytes
   per second: a copy moves twice that through memory);
3. the probe's overhead per step on the ``code-lm`` model (``poise/bench/probe_overhead.py``):
   target at most 1 % of the step.

It writes ``<out>/gpu_check.json``: the device's name, torch's and CUDA's versions, every
phase's figures, and ``ok``. ``--dry-run`` runs the same code paths on the CPU with tiny sizes
(no device needed; the JSON says ``"dry_run": true``) so that the suite can check the check.

    python -m poise.bench.gpu --out runs/gpu-check            # on a machine with a GPU
    python -m poise.bench.gpu --dry-run --out runs/gpu-dry    # anywhere
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from poise.bench import probe_overhead
from poise.bench.codecs import KERNEL_CASES, KernelCase
from poise.comm import codecs
from poise.files import write_json_atomic
from poise.log import make_console

ROOT = Path(__file__).resolve().parents[2]
RESULT = "gpu_check.json"
TESTS_TIMEOUT_S = 300.0  # the cuda tests' share of the 8 minutes
MAX_MBYTES = 4096.0  # the codec tensor's bound: a quarter of a small card, far below an H100's 80 GB


def test_paths(root: Path = ROOT) -> list[str]:
    """The files that hold ``cuda`` tests, relative to ``root``: ``tests/cuda/`` and every
    ``tests/*/test_*_cuda.py`` (collecting only these keeps the check free of the rest of the
    suite's imports, which a lent machine's environment may lack)."""
    paths = ["tests/cuda"] if (root / "tests" / "cuda").is_dir() else []
    return paths + sorted(str(p.relative_to(root)) for p in root.glob("tests/*/test_*_cuda.py")
                          if p.parent.name != "cuda")


def device_facts(device: torch.device) -> dict[str, Any]:
    """What ran the check: the device's name and memory, torch's, CUDA's and NCCL's versions."""
    facts: dict[str, Any] = {"type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
                             "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(name=props.name, capability=f"{props.major}.{props.minor}",
                     memory_gb=round(props.total_memory / 1e9, 1), multiprocessors=props.multi_processor_count,
                     nccl=_nccl_version())
    else:
        facts.update(name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return facts


def _nccl_version() -> str | None:
    """NCCL's version as torch reports it (a tuple in torch 2.x), or None without NCCL."""
    if not dist.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _counts(junit: Path) -> dict[str, Any]:
    """Passed, failed, errors and skipped tests from pytest's JUnit XML, with the failures' names."""
    if not junit.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skip_reasons": []}
    failures, reasons = [], set()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reasons.add(outcome.get("message", ""))
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            message = (outcome.get("message") or "").strip()
            failures.append(f"{name}: {message.splitlines()[0][:300] if message else outcome.tag}")
    return {**counts, "failures": failures, "skip_reasons": sorted(reasons)}


def run_cuda_tests(out_dir: Path, timeout_s: float, say: Callable[[str], None], *,
                   paths: list[str] | None = None, cwd: Path = ROOT) -> dict[str, Any]:
    """``pytest -m cuda`` over ``paths`` (default :func:`test_paths`) from ``cwd``, its output in
    ``<out>/cuda_tests.log``; the counts and failures read from its JUnit XML."""
    junit = (out_dir / "cuda_tests.xml").resolve()
    junit.unlink(missing_ok=True)  # an earlier run's counts must not pass for this one's
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(paths if paths is not None else test_paths())]
    say(f"cuda tests: {' '.join(cmd[1:])}")
    start = time.perf_counter()
    with open(out_dir / "cuda_tests.log", "w") as log_file:
        try:
            code: int | None = subprocess.run(cmd, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT,
                                              timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    result = {"command": cmd[1:], "exit_code": code, "timed_out": code is None,
              "seconds": round(time.perf_counter() - start, 1), **_counts(junit)}
    say(f"cuda tests: {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
        f"{result['skipped']} skipped in {result['seconds']} s" + (" (timed out)" if code is None else ""))
    for failure in result["failures"]:
        say(f"  FAILED {failure}")
    return result


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(wall seconds, result)`` of ``fn`` with the device drained before and after (a CPU/GPU
    sync point: this is a benchmark; it also charges a codec for any sync of its own)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def _kernel_row(case: KernelCase, x: torch.Tensor, copy_dst: torch.Tensor, repeats: int, warmup: int) -> dict[str, Any]:
    """Median encode, decode and copy seconds of ``case`` on ``x`` (copies interleaved), and rates."""
    codec = codecs.make(case.name, **case.options)
    out = torch.empty_like(x)
    encode_s, decode_s, copy_s = [], [], []
    encoded = None
    for i in range(warmup + repeats):
        t_copy, _ = _timed(x.device, lambda: copy_dst.copy_(x))
        t_encode, encoded = _timed(x.device, lambda: codec.encode(x, key=0))
        t_decode, _ = _timed(x.device, lambda enc=encoded: codec.decode(enc, out=out))
        if i >= warmup:
            copy_s.append(t_copy)
            encode_s.append(t_encode)
            decode_s.append(t_decode)
    assert encoded is not None
    nbytes = x.numel() * x.element_size()
    codec_s = statistics.median(e + d for e, d in zip(encode_s, decode_s, strict=True))
    memcpy_s = statistics.median(copy_s)
    return {"codec": case.label, "options": case.options, "encode_ms": 1e3 * statistics.median(encode_s),
            "decode_ms": 1e3 * statistics.median(decode_s), "codec_gb_per_s": nbytes / codec_s / 1e9,
            "copy_gb_per_s": nbytes / memcpy_s / 1e9, "vs_copy": memcpy_s / codec_s,
            "compression_ratio": nbytes / codec.nbytes(encoded), "copy_s": copy_s}


def codec_kernels(device: torch.device, mbytes: float, repeats: int, warmup: int,
                  say: Callable[[str], None]) -> dict[str, Any]:
    """Encode + decode throughput of every kernel case of ``poise bench codecs`` on ``device``,
    against ``dst.copy_(src)`` of the same float32 tensor measured between its repeats."""
    numel = int(mbytes * 1e6) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    copy_dst = torch.empty_like(x)
    rows, copies = [], []
    for case in KERNEL_CASES:
        row = _kernel_row(case, x, copy_dst, repeats, warmup)
        copies += row.pop("copy_s")
        rows.append(row)
        say(f"  {case.label:>10}: encode {row['encode_ms']:.3f} ms, decode {row['decode_ms']:.3f} ms, "
            f"{row['codec_gb_per_s']:.1f} GB/s = {row['vs_copy']:.3f} x copy")
    copy_gb_per_s = numel * 4 / statistics.median(copies) / 1e9
    return {"mbytes": numel * 4 / 1e6, "numel": numel, "repeats": repeats, "warmup": warmup,
            "copy_gb_per_s": copy_gb_per_s, "copy_memory_traffic_gb_per_s": 2 * copy_gb_per_s, "rows": rows}


def _process_group(device: torch.device) -> bool:
    """A process group of one rank for the session (NCCL on a GPU, gloo on the CPU); whether
    this call made it (then the caller destroys it)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=120))
    return True


def _phase(run: Callable[[], dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """``run()``, or ``{"error": ...}`` when it raises: one failed bench must not cost the lent
    machine's other figures (the error is printed and kept in the JSON)."""
    try:
        return run()
    except Exception as exc:  # reported, not hidden: ok is false then
        line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
        say(f"  FAILED {line}")
        return {"error": line}


def _probe(device: torch.device, size: probe_overhead.ModelSize, steps: int, dry_run: bool,
           say: Callable[[str], None]) -> dict[str, Any]:
    """One model size of the probe bench, and its summary line."""
    row = probe_overhead.measure(size, device, steps=steps, warmup=1 if dry_run else 10, rounds=2 if dry_run else 5,
                                 say=say)
    say(f"  {size.label}: step {row['step_ms']['ddp']:.2f} ms (ddp), {row['step_ms']['session']:.2f} ms (session): "
        f"probe overhead {row['probe_overhead_pct']:+.2f} % ({row['probe_overhead_ms']:+.3f} ms; "
        f"target <= {row['target_pct']} %)")
    return row


def check(out_dir: Path, *, dry_run: bool, tests: bool, codec_mbytes: float, sizes: list[str],
          probe_steps: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Run the check's phases (see module doc) and write ``<out_dir>/gpu_check.json``; returns its content.

    Raises:
        ValueError: no CUDA device and not ``dry_run``, or a bad size.
    """
    if not dry_run and not torch.cuda.is_available():
        raise ValueError(f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none; "
                         "run on a machine with a GPU, or pass --dry-run")
    if not 0 < codec_mbytes <= MAX_MBYTES:
        raise ValueError(f"--codec-mbytes={codec_mbytes} must be in (0, {MAX_MBYTES:g}]")
    unknown = [s for s in sizes if s not in probe_overhead.SIZES]
    if unknown or not sizes:
        raise ValueError(f"--sizes={','.join(sizes)!r}: allowed are {', '.join(probe_overhead.SIZES)}")
    if probe_steps < 1:
        raise ValueError(f"--probe-steps={probe_steps} must be positive")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device()) if not dry_run else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    facts = device_facts(device)
    say(f"gpu check{' (dry run, CPU)' if dry_run else ''}: {facts['name']}, torch {facts['torch']}, "
        f"CUDA {facts['cuda']}")
    result: dict[str, Any] = {"bench": "gpu_check", "dry_run": dry_run, "device": facts,
                              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = out_dir / RESULT
    write_json_atomic(path, result)  # after every phase: a run cut short still leaves what it measured
    result["tests"] = run_cuda_tests(out_dir, TESTS_TIMEOUT_S, say) if tests else None
    write_json_atomic(path, result)
    say(f"codec kernels on {device}, {codec_mbytes:g} MB float32:")
    result["codecs"] = _phase(lambda: codec_kernels(device, codec_mbytes, repeats=2 if dry_run else 10,
                                                    warmup=1 if dry_run else 3, say=say), say)
    write_json_atomic(path, result)
    say(f"probe overhead per step (code-lm model, {device}):")
    made = _process_group(device)  # one rank: what a Session needs
    try:
        result["probe"] = [_phase(lambda s=s: _probe(device, probe_overhead.SIZES[s], probe_steps, dry_run, say),
                                  say) for s in sizes]
    finally:
        if made:
            dist.destroy_process_group()
    # exit code 0: collected, none failed (5, nothing collected, is a failure of the check itself)
    tests_ok = result["tests"] is None or (result["tests"]["exit_code"] == 0 and not result["tests"]["failed"]
                                           and not result["tests"]["errors"])
    benches_ok = "error" not in result["codecs"] and all("error" not in row for row in result["probe"])
    result["ok"] = tests_ok and benches_ok
    result["probe_meets_target"] = benches_ok and all(row["meets_target"] for row in result["probe"])
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json_atomic(path, result)
    target = "met" if result["probe_meets_target"] else "missed"
    say(f"wrote {path} in {result['elapsed_s']} s: tests {'ok' if tests_ok else 'FAILED'}, benches "
        f"{'ok' if benches_ok else 'FAILED'}, probe target "
        + (f"{target} (dry run: CPU timings of tiny sizes, no figure of a GPU)" if dry_run else target))
    return result


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when the tests passed, 1 when one failed, 2 for bad input (one line)."""
    parser = argparse.ArgumentParser(prog="python -m poise.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu-check", help="where gpu_check.json and the test log go")
    parser.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU, tiny sizes")
    parser.add_argument("--no-tests", dest="tests", action="store_false", help="skip the cuda tests")
    parser.add_argument("--codec-mbytes", type=float, default=None,
                        help="size of the codec bench's tensor in MB (default 256; dry run 1)")
    parser.add_argument("--sizes", default=None,
                        help=f"code-lm model sizes for the probe bench, of {', '.join(probe_overhead.SIZES)} "
                             "(default default,gpu; dry run tiny)")
    parser.add_argument("--probe-steps", type=int, default=None, help="timed steps per variant and round "
                                                                      "(default 20; dry run 1)")
    args = parser.parse_args(argv)
    console = make_console()
    sizes = (args.sizes if args.sizes is not None else "tiny" if args.dry_run else "default,gpu").split(",")
    mbytes = args.codec_mbytes if args.codec_mbytes is not None else 1.0 if args.dry_run else 256.0
    steps = args.probe_steps if args.probe_steps is not None else 1 if args.dry_run else 20
    try:
        result = check(Path(args.out), dry_run=args.dry_run, tests=args.tests, codec_mbytes=mbytes, sizes=sizes,
                       probe_steps=steps,
                       say=lambda line: console.print(line, markup=False, highlight=False))
    except ValueError as exc:
        make_console(stderr=True).print(f"gpu check: {exc}", markup=False, highlight=False)
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
