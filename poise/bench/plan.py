"""``poise bench plan``: the cost model's predictions against published and measured figures.

1. The published 8×H200 NVLink all-reduce table (busbw with NVLS; torch 2.9.1, NCCL 2.27.7):
   α and β are fitted on two of its sizes (``--fit-sizes``) and the others predicted, side by
   side, for the depth-2 pipelined model (NVLS: reduce in the switch, multicast back) and,
   for comparison, the plain linear α-β of a ring.
2. On the emulated cluster (``poise cluster``; needs root): calibrate, predict, then run. The
   calibration: codec encode/decode seconds with error feedback on the model's buckets (one
   thread), ``poise diagnose busbw`` of the backend all-reduce at three sizes on two local
   workers (the link inside a node), and before each scenario's jobs, a single-worker run of
   the model, the cluster's number of workers run locally (its nodes share this machine's
   cores: their slow-down per phase; their all-reduce, whose gradient bytes over its busy
   seconds cap every link of the cluster; and the wait per step of time-sliced workers, its
   step less its compute phases, under which the collectives' own host seconds hide, and with
   the flat collectives each rank's codec seconds) and the
   same busbw on the cluster (its node links). Every job of the matrix (links × clusters ×
   codecs × collectives) is predicted from those alone, then run as a real ``poise train
   --cluster`` job; its measured step is the median over steps after ``--warmup-steps`` of
   the slowest rank's step. Rows go to
   ``plan-validation.json`` as they come (``predicted_s``, ``measured_s``, ``error`` =
   predicted / measured − 1), so an interrupted run keeps what it measured; ``--from DIR``
   predicts again from a finished run's calibration and compares with its measurements
   (it runs no job: everything above comes from the run's calibration block).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from poise.bench.harness import output_dir, require_positive, run_train_job, save_results, show_table
from poise.files import write_json_atomic
from poise.plan import calibrate
from poise.plan.costs import Cluster, pipelined_s, ring_all_reduce_s
from poise.plan.planner import CODEC_OPTIONS, prefer_simple
from poise.plan.step_time import StepConfig, predict_step
from poise.units import parse_rate_bit_per_s

log = logging.getLogger(__name__)

HELP = "cost model vs the published 8xH200 all-reduce table and vs real jobs on the emulated cluster"

MIB = 1 << 20
# 8x H200, NVLink, all-reduce busbw with NVLS, GB/s (torch 2.9.1, NCCL 2.27.7)
H200_NVLS_BUSBW_GB_PER_S = {1 * MIB: 39.9, 16 * MIB: 219.9, 64 * MIB: 346.5, 256 * MIB: 436.2,
                            1024 * MIB: 463.6, 16384 * MIB: 482.3}
H200_RANKS = 8
H200_FIT_SIZES = (1 * MIB, 1024 * MIB)

MODEL = {"d_model": 256, "num_layers": 4, "num_heads": 4, "max_seq_len": 32}
MODEL_ARGS = ("--task", "code-lm", "--task.d_model", str(MODEL["d_model"]), "--task.num_layers",
              str(MODEL["num_layers"]), "--task.num_heads", str(MODEL["num_heads"]), "--max-seq-len",
              str(MODEL["max_seq_len"]), "--batch-size", "1", "--task.eval_max_samples", "16",
              "--comm.start_step", "2")
CODECS = ("none", "fp16", "sign", "topk", "powersgd")
COLLECTIVES = ("flat", "hierarchical")
BUSBW_SIZES = ("256K", "2M", "16M")


# -- 1. the published table -----------------------------------------------------------------------


def h200_table(fit_sizes: tuple[int, int] = H200_FIT_SIZES) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Published vs predicted busbw per size (bytes, GB/s), for the pipelined and the linear
    model, each fitted on ``fit_sizes``; and the fitted links."""
    n = H200_RANKS
    factor = 2 * (n - 1) / n
    times = {s: factor * s / (bw * 1e9) for s, bw in H200_NVLS_BUSBW_GB_PER_S.items()}
    points = [(float(s), times[s]) for s in fit_sizes]
    pipelined = calibrate.fit_pipelined_link(points, depth=2)
    ring = calibrate.fit_ring_link(points, n)
    ring_cluster = Cluster(1, n, ring, ring)
    rows = []
    for size, published in H200_NVLS_BUSBW_GB_PER_S.items():
        pred = factor * size / pipelined_s(pipelined, size, 2) / 1e9
        linear = factor * size / ring_all_reduce_s(ring_cluster, size) / 1e9
        rows.append({"size_bytes": size, "published_gb_per_s": published, "predicted_gb_per_s": pred,
                     "error": pred / published - 1, "linear_gb_per_s": linear, "linear_error": linear / published - 1,
                     "fitted": size in fit_sizes})
    fit = {name: {"latency_s": link.latency_s, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
           for name, link in (("pipelined", pipelined), ("linear_ring", ring))}
    return rows, fit


def show_h200(rows: list[dict[str, Any]], fit: dict[str, Any]) -> None:
    from poise.units import format_size_bytes

    p = fit["pipelined"]
    show_table(
        f"8xH200 NVLS all-reduce busbw: published vs predicted (fitted on "
        f"{', '.join(format_size_bytes(r['size_bytes']) for r in rows if r['fitted'])}; "
        "pipelined depth 2, "
        f"α = {p['latency_s'] * 1e6:.2f} us, 1/β = {p['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)",
        [{**r, "size": format_size_bytes(r["size_bytes"]), "used": "fit" if r["fitted"] else "predicted"}
         for r in rows],
        [("size", "size", str), ("used", "point", str),
         ("published_gb_per_s", "published GB/s", lambda v: f"{v:.1f}"),
         ("predicted_gb_per_s", "predicted GB/s", lambda v: f"{v:.1f}"),
         ("error", "error", lambda v: f"{v:+.1%}"),
         ("linear_gb_per_s", "linear α-β GB/s", lambda v: f"{v:.1f}"),
         ("linear_error", "linear error", lambda v: f"{v:+.1%}")])


# -- 2. the emulated cluster ----------------------------------------------------------------------


def model_params() -> list[Any]:
    """The validation model's parameter tensors (built here, on the CPU, for their shapes)."""
    from poise.plan.model import params_of
    from poise.tasks.code_lm import ByteTransformer

    return params_of(ByteTransformer(**MODEL))


def _run(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as handle:
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}, see {log_path})")


def busbw_json(out: Path, where: list[str], timeout_s: float) -> dict[str, Any]:
    """``poise diagnose busbw`` of the backend all-reduce at :data:`BUSBW_SIZES` (``where``:
    ``--cluster N:M --link L`` or ``--nproc 2``). Medians of 15 calls: with 3, one run's
    calibration of a 100 Mbit/s link came out 8 % slow, and every job of that scenario with it."""
    cmd = [sys.executable, "-m", "poise", "diagnose", "busbw", *where, "--ops", "all_reduce", "--min-bytes",
           BUSBW_SIZES[0], "--max-bytes", BUSBW_SIZES[-1], "--factor", "8", "--warmup", "3", "--repeats", "15",
           "--out", str(out)]
    _run(cmd, out / "diagnose.log", timeout_s)
    return json.loads((out / "busbw.json").read_text())


def measure_codec_speeds(params: list[Any], codecs: list[str], payloads: int, *, repeats: int = 5,
                         bucket_mb: float = 25.0) -> dict[str, dict[str, float]]:
    """Encode and decode seconds per gradient byte of each codec as a job runs it, on one thread:
    error feedback around it, over the model's DDP buckets, decoding ``payloads`` ranks' payloads
    (all-gather codecs), PowerSGD's steps on each bucket's matrices. Medians of ``repeats``."""
    import time

    import torch

    from poise.comm.codecs import ErrorFeedback
    from poise.comm.codecs import make as make_codec
    from poise.plan.step_time import plan_buckets

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        buckets = plan_buckets(params, bucket_mb * MIB)
        generator = torch.Generator().manual_seed(0)
        grads = [torch.randn(b.numel, generator=generator) for b in buckets]
        inputs = [torch.empty_like(g) for g in grads]  # the bucket, overwritten each call (as DDP's is)
        results = [torch.empty_like(g) for g in grads]
        raw = 4.0 * sum(b.numel for b in buckets)
        out: dict[str, dict[str, float]] = {}
        for name in codecs:
            if name == "none":
                continue
            codec = ErrorFeedback(make_codec(name, **CODEC_OPTIONS.get(name, {})))
            enc_times, dec_times = [], []
            for _ in range(repeats + 1):
                enc = dec = 0.0
                for key, (bucket, grad, g, result) in enumerate(zip(buckets, grads, inputs, results, strict=True)):
                    g.copy_(grad)
                    start = time.perf_counter()
                    if name == "powersgd":
                        enc_s, dec_s = _powersgd_seconds(codec, g, bucket, key, result)
                        enc += enc_s
                        dec += dec_s
                        continue
                    encoded = codec.encode(g, key=key)
                    mid = time.perf_counter()
                    if codec.summable:
                        codec.decode(encoded, out=result)
                    else:
                        codec.decode_sum([encoded] * payloads, out=result)
                    enc += mid - start
                    dec += time.perf_counter() - mid
                enc_times.append(enc)
                dec_times.append(dec)
            out[name] = {"encode_s_per_byte": statistics.median(enc_times[1:]) / raw,
                         "decode_s_per_byte": statistics.median(dec_times[1:]) / raw}
        return out
    finally:
        torch.set_num_threads(threads)


def _powersgd_seconds(codec: Any, grad: Any, bucket: Any, key: int, result: Any) -> tuple[float, float]:
    """The reducer's PowerSGD steps on one bucket, communication left out: (encode s, decode s)."""
    import time

    import torch

    lowrank = codec.codec
    layout = lowrank.layout(bucket.numel, list(bucket.shapes))
    if not layout.blocks:
        return 0.0, 0.0
    start = time.perf_counter()
    corrected = codec.correct_in_place(grad, key)
    round1 = torch.empty(layout.p_numel + layout.dense_numel)
    p, dense = round1[: layout.p_numel], round1[layout.p_numel:]
    lowrank.project_p(corrected, layout, key, p)
    layout.gather_dense(corrected, dense)
    lowrank.orthonormalize(p, layout)
    q = lowrank.project_q(corrected, p, layout, key)
    lowrank.subtract(layout, p, q, corrected)
    mid = time.perf_counter()
    lowrank.remember(key, q)
    lowrank.expand(layout, p, q, result, dense)
    return mid - start, time.perf_counter() - mid


def measured_step_s(run_dir: Path, warmup_steps: int) -> float:
    """Median over steps after ``warmup_steps`` of the slowest rank's step seconds."""
    from poise.diagnostics.timeline import column, load_table

    steps = column(load_table(run_dir / "timeline.npz"), "step_s").max(axis=0)
    return float(statistics.median(steps[warmup_steps:] if len(steps) > warmup_steps else steps))


def predict_row(calibration: dict[str, Any], link: str, nodes: int, procs: int, codec: str, collective: str,
                params: list[Any]) -> dict[str, Any]:
    """Predicted step of one job of the matrix from the calibration alone.

    The emulated cluster's nodes share this machine's cores, so the scenario's local run of
    its workers (``compute[key]["shared"]``) gives three things: the slow-down of each compute
    phase, the machine's own all-reduce among that many workers (``calibrate.host_link``: a cap
    on every link, node links and links inside a node alike) and the wait per step of workers
    time-sliced on the cores (``calibrate.sharing_s``), under which the machine's own
    reduction hides (``predict_step``'s ``host``), and with the flat collectives each rank's
    codec seconds (``step.hidden_by_sharing_s``).
    """
    from dataclasses import replace

    inter = calibrate.fit_ring_link(calibrate.busbw_points(calibration["busbw"][f"{link}-{nodes}x{procs}"]),
                                    nodes * procs)
    intra = calibrate.fit_ring_link(calibrate.busbw_points(calibration["busbw"]["local-2"]), 2)
    scenario = calibration["compute"][f"{link}-{nodes}x{procs}"]
    host = calibrate.host_link(scenario["shared"])
    compute, _ = calibrate.shared_compute(scenario["single"], scenario["shared"])
    compute = replace(compute, sharing_s=calibrate.sharing_s(scenario["shared"], compute))
    # one node's link as the ring sees it: a ring of n ranks over the nodes is limited by it
    cluster = Cluster(nodes, procs, calibrate.capped(intra, host), calibrate.capped(inter, host))
    speeds = calibrate.codec_speeds(calibration["codec_speeds"][str(nodes * procs)])
    leader_speeds = calibrate.codec_speeds(calibration["codec_speeds"][str(nodes)])
    pred = predict_step(cluster, params, compute, StepConfig(codec, collective, 25.0, CODEC_OPTIONS[codec]), speeds,
                        leader_speeds=leader_speeds, host=Cluster(nodes, procs, host, host))
    return {"predicted_s": pred.step_s, "predicted_comm_s": pred.comm_s, "predicted_exposed_s": pred.exposed_comm_s,
            "predicted_codec_s": pred.codec_s, "predicted_sharing_s": pred.sharing_s,
            "sharing_wait_s": compute.sharing_s, "inter_latency_s": inter.latency_s,
            "inter_bandwidth_bytes_per_s": inter.bandwidth_bytes_per_s,
            "host_bandwidth_bytes_per_s": host.bandwidth_bytes_per_s}


def matrix(links: list[str], clusters: list[tuple[int, int]], codecs: list[str],
           collectives: list[str]) -> list[tuple[str, int, int, str, str]]:
    """Jobs, scenario by scenario; one worker per node runs flat only (hierarchical is the same ranks)."""
    jobs = []
    for link in links:
        for nodes, procs in clusters:
            for collective in collectives:
                if collective != "flat" and procs == 1:
                    continue
                for codec in codecs:
                    jobs.append((link, nodes, procs, codec, collective))
    return jobs


def validate(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Calibrate, predict, run (or re-read ``--from``) and compare; returns plan-validation.json's data."""
    links = [t.strip() for t in args.links.split(",") if t.strip()]
    for link in links:
        parse_rate_bit_per_s(link, what="link rate")
    clusters = [(int(a), int(b)) for a, b in (c.split(":") for c in args.clusters.split(",") if c.strip())]
    codecs = [c for c in args.codecs.split(",") if c]
    collectives = [c for c in args.collectives.split(",") if c]
    params = model_params()
    previous = json.loads((out / "plan-validation.json").read_text()) if args.from_dir else None
    if previous:  # the same jobs again, predicted by today's model; the first file is kept
        jobs = [(r["link"], r["nodes"], r["procs_per_node"], r["codec"], r["collective"]) for r in previous["rows"]]
        path = out / "plan-validation-again.json"
    else:
        jobs = matrix(links, clusters, codecs, collectives)[: args.max_jobs or None]
        path = out / "plan-validation.json"
    calibration: dict[str, Any] = previous["calibration"] if previous else {
        "cores": os.cpu_count() or 1, "busbw": {}, "compute": {}, "codec_speeds": {}}
    data: dict[str, Any] = {"model": MODEL, "model_args": list(MODEL_ARGS), "steps": args.steps,
                            "warmup_steps": args.warmup_steps, "calibration": calibration, "rows": []}
    train = [*MODEL_ARGS, "--steps", str(args.steps)]
    if not previous:
        for payloads in sorted({n * m for n, m in clusters} | {n for n, _ in clusters}):
            calibration["codec_speeds"][str(payloads)] = measure_codec_speeds(params, codecs, payloads)
        calibration["busbw"]["local-2"] = busbw_json(out / "calibrate-busbw-local", ["--nproc", "2"], args.timeout_s)
        write_json_atomic(path, data)
    measured = {(r["link"], r["nodes"], r["procs_per_node"], r["codec"], r["collective"]): r
                for r in (previous["rows"] if previous else [])}
    for link, nodes, procs, codec, collective in jobs:
        key = f"{link}-{nodes}x{procs}"
        if not previous and key not in calibration["busbw"]:
            # right before the scenario's jobs, so that the machine's other load is the same
            calibration["compute"][key] = {
                "single": run_train_job(f"calibrate-{key}-single", out,
                                        [*train, "--nproc", "1", "--dist.threads_per_worker", "1"], args.timeout_s),
                # the cluster's number of workers on this machine, locally (no shaped links): their
                # compute phases, communication waits left out
                "shared": run_train_job(f"calibrate-{key}-local", out,
                                        [*train, "--nproc", str(nodes * procs), "--dist.threads_per_worker", "1"],
                                        args.timeout_s)}
            calibration["busbw"][key] = busbw_json(out / f"calibrate-busbw-{key}",
                                                   ["--cluster", f"{nodes}:{procs}", "--link", link], args.timeout_s)
        row: dict[str, Any] = {"link": link, "nodes": nodes, "procs_per_node": procs, "codec": codec,
                               "collective": collective}
        try:
            row.update(predict_row(calibration, link, nodes, procs, codec, collective, params))
        except Exception as exc:  # keep measuring: the prediction can be redone with --from
            log.warning("prediction of %s failed: %s", row, exc)
        if previous:
            old = measured.get((link, nodes, procs, codec, collective))
            if old is None or "measured_s" not in old:
                continue
            row["measured_s"] = old["measured_s"]
            row["report"] = old.get("report", {})
        else:
            name = f"{key}-{codec}-{collective}"
            try:
                report = run_train_job(name, out, [*train, "--cluster", f"{nodes}:{procs}", "--link", link,
                                                   "--codec", codec, "--collective", collective], args.timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                log.warning("job %s failed: %s", name, exc)
                row["failed"] = str(exc)
                data["rows"].append(row)
                write_json_atomic(path, data)
                continue
            row["measured_s"] = measured_step_s(out / name, args.warmup_steps)
            row["report"] = {k: report.get(k) for k in ("median_step_s", "comm_wire_bytes_per_step",
                                                          "comm_exposed_s_per_step", "codec_s_per_step")}
        if "predicted_s" in row:
            row["error"] = row["predicted_s"] / row["measured_s"] - 1
        data["rows"].append(row)
        write_json_atomic(path, data)
    data["summary"] = summarize(data["rows"])
    write_json_atomic(path, data)
    return data


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst |error|; per scenario (link, cluster), whether the recommended
    configuration (the predicted fastest, the simplest within ``TIE_MARGIN`` of it, as
    ``poise plan`` recommends) is the measured fastest or within 5 % of it."""
    done = [r for r in rows if "error" in r]
    errors = sorted(abs(r["error"]) for r in done)
    scenarios: dict[str, list[dict[str, Any]]] = {}
    for r in done:
        scenarios.setdefault(f"{r['link']} {r['nodes']}x{r['procs_per_node']}", []).append(r)
    hits = {}
    for name, group in scenarios.items():
        if len(group) < 2:
            continue
        recommended = prefer_simple(group, lambda r: r["predicted_s"], lambda r: r["codec"], lambda r: r["collective"])
        assert recommended is not None
        fastest = min(group, key=lambda r: r["measured_s"])
        hits[name] = {"recommended": f"{recommended['codec']}+{recommended['collective']}",
                      "measured_fastest": f"{fastest['codec']}+{fastest['collective']}",
                      "ratio": recommended["measured_s"] / fastest["measured_s"],
                      "hit": recommended["measured_s"] <= 1.05 * fastest["measured_s"]}
    return {"jobs": len(done), "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": errors[-1] if errors else None,
            "recommendation_hit_rate": (sum(h["hit"] for h in hits.values()) / len(hits)) if hits else None,
            "scenarios": hits}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--published-only", action="store_true", help="only the published H200 table (no jobs)")
    parser.add_argument("--links", default="100mbit,1gbit,10gbit", help="link rates of the emulated cluster")
    parser.add_argument("--clusters", default="2:2,4:1", help="nodes:workers per node, comma-separated")
    parser.add_argument("--codecs", default=",".join(CODECS), help="codecs of the matrix")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES), help="collectives of the matrix")
    parser.add_argument("--steps", type=int, default=30, help="steps per job")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the measured median")
    parser.add_argument("--max-jobs", type=int, default=0, help="run only the first N jobs of the matrix (0: all)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per job, seconds")
    parser.add_argument("--from", dest="from_dir", default="", help="predict again for a finished run's directory")
    parser.add_argument("--out", default="", help="output directory (default runs/bench-plan-<timestamp>)")


def run(args: argparse.Namespace) -> int:
    require_positive(args, "steps", "timeout_s")
    rows, fit = h200_table()
    show_h200(rows, fit)
    out = Path(args.from_dir) if args.from_dir else output_dir(args.out, "plan")
    result: dict[str, Any] = {"h200": {"rows": rows, "fit": fit, "ranks": H200_RANKS}}
    if not args.published_only:
        data = validate(out, args)
        show_validation(data)
        result["validation"] = data["summary"]
    save_results(out, "plan", result)
    return 0


def show_validation(data: dict[str, Any]) -> None:
    rows = [r for r in data["rows"] if "measured_s" in r]
    show_table("poise bench plan: predicted vs measured step (emulated cluster)", rows, [
        ("link", "link", str), ("nodes", "nodes", str), ("procs_per_node", "x", str), ("codec", "codec", str),
        ("collective", "collective", str), ("predicted_s", "predicted", lambda v: f"{v * 1e3:.0f} ms"),
        ("measured_s", "measured", lambda v: f"{v * 1e3:.0f} ms"), ("error", "error", lambda v: f"{v:+.1%}")])
    s = data["summary"]
    show_table("poise bench plan: summary", [{
        "jobs": s["jobs"], "median": s["median_abs_error"], "worst": s["worst_abs_error"],
        "hits": s["recommendation_hit_rate"]}], [
        ("jobs", "jobs", str), ("median", "median |error|", lambda v: "-" if v is None else f"{v:.1%}"),
        ("worst", "worst |error|", lambda v: "-" if v is None else f"{v:.1%}"),
        ("hits", "recommendation = measured fastest (5 %)", lambda v: "-" if v is None else f"{v:.0%}")])


__all__ = ["HELP", "add_arguments", "h200_table", "run"]

