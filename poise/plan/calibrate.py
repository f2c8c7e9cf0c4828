"""Calibration: α and β of a link from measured collective times, compute from measured runs.

Kept apart from prediction (``costs.py``, ``step_time.py``): these functions turn measurements
(``poise diagnose busbw``'s ``busbw.json``, a single-worker ``report.json``, a layer profile,
``poise bench codecs``' kernel table) into the numbers a prediction takes, and say where each
number came from. A two-point fit is exact; with three or more points the slope is the
median of the pairwise slopes weighted by their size differences (Theil 1950, Sen 1968, with
Sievers' 1978 weights), so that calls caught by the ~4 ms tail latency of small messages do not
tilt the line, as they would a least-squares fit. The weights matter on a geometric size
ladder: most pairs join two small sizes, whose slope is latency noise over a few kB, and an
unweighted median let them outvote the pairs that span the bandwidth-bound sizes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from poise.plan.costs import Link, pipelined_s
from poise.plan.step_time import CodecSpeed, Compute


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Robust line ``t = a + b S`` through ``(S, t)`` points (exact through two).

    ``b`` is the median of the slopes between every pair of distinct sizes, each weighted by
    ``|S2 - S1|`` (a pair's slope error is its time noise over that span), and ``a`` the median
    of ``t - b S``. O(n² log n) for n points.
    """
    if len(points) < 2 or len({s for s, _ in points}) < 2:
        raise ValueError(f"a fit needs at least two distinct sizes, got {[s for s, _ in points]}")
    slopes, spans = zip(*(((t2 - t1) / (s2 - s1), abs(s2 - s1))
                          for i, (s1, t1) in enumerate(points) for s2, t2 in points[i + 1:] if s2 != s1),
                        strict=True)
    b = float(np.quantile(slopes, 0.5, weights=spans, method="inverted_cdf"))  # the weighted median
    return statistics.median(t - b * s for s, t in points), b


def fit_ring_link(points: Sequence[tuple[float, float]], world_size: int) -> Link:
    """The link whose ring all-reduce over ``world_size`` ranks takes the measured seconds.

    A ring costs ``2(n-1) α + 2(n-1)/n S β`` (``costs.ring_all_reduce_s``): the line through
    ``(S bytes, t seconds)`` gives ``α = a / 2(n-1)`` and ``1/β = 2(n-1) / (n b)``.

    Raises:
        ValueError: fewer than two sizes, fewer than two ranks, or times that do not grow with size.
    """
    n = world_size
    if n < 2:
        raise ValueError(f"a ring link needs >= 2 ranks, got {n}")
    a, b = _line(points)
    if not b > 0:
        raise ValueError(f"all-reduce times {[t for _, t in points]} do not grow with size: no bandwidth to fit")
    return Link(max(0.0, a) / (2 * (n - 1)), 2 * (n - 1) / (n * b))


def fit_pipelined_link(points: Sequence[tuple[float, float]], depth: int) -> Link:
    """α and β of a depth-``depth`` pipeline (``costs.pipelined_s``) through two ``(S, t)`` points.

    Solved by bisection on α (β follows from the larger point), since the best segment count
    makes the cost piecewise in both.

    Raises:
        ValueError: not exactly two distinct sizes.
    """
    if len(points) != 2 or points[0][0] == points[1][0]:
        raise ValueError(f"a pipelined fit takes exactly two distinct sizes, got {[s for s, _ in points]}")
    (s1, t1), (s2, t2) = sorted(points)

    def beta_for(alpha: float) -> float:
        lo, hi = 0.0, 2 * t2 / s2
        for _ in range(100):
            mid = (lo + hi) / 2
            if pipelined_s(Link(alpha, 1 / mid if mid else float("inf")), s2, depth) > t2:
                hi = mid
            else:
                lo = mid
        return max(lo, 1e-30)

    lo, hi = 0.0, t1
    for _ in range(100):
        mid = (lo + hi) / 2
        if pipelined_s(Link(mid, 1 / beta_for(mid)), s1, depth) > t1:
            hi = mid
        else:
            lo = mid
    return Link(lo, 1 / beta_for(lo))


def busbw_points(busbw: dict[str, Any], op: str = "all_reduce") -> list[tuple[float, float]]:
    """``(size bytes, median seconds)`` of ``op`` from a ``busbw.json``.

    Raises:
        ValueError: the file has no timing of ``op``.
    """
    points = [(float(r["size_bytes"]), float(r["time_s"])) for r in busbw.get("results", [])
              if r.get("op") == op and not r.get("error")]
    if not points:
        raise ValueError(f"busbw.json has no measurement of {op!r}")
    return points


def compute_from_report(report: dict[str, Any]) -> Compute:
    """One worker's compute from a ``report.json``: rank 0's median data, forward, backward
    and optimizer seconds (a single-worker run: nothing waits for anyone)."""
    rank0 = report["per_rank"][0]
    return Compute(forward_s=rank0["median_forward_s"], backward_s=rank0["median_backward_s"],
                   optimizer_s=rank0["median_optim_s"], data_s=rank0["median_data_s"],
                   source=f"measured: single-worker run, {report['steps']} steps (medians)")


def _phases(report: dict[str, Any]) -> dict[str, float]:
    """Median over ranks of each rank's median forward, backward, optimizer and data seconds."""
    return {k: statistics.median(r[f"median_{k}_s"] for r in report["per_rank"])
            for k in ("forward", "backward", "optim", "data")}


def shared_compute(single: dict[str, Any], shared: dict[str, Any]) -> tuple[Compute, dict[str, float]]:
    """Compute of a worker among others on the same machine's cores (the emulated cluster).

    ``single`` is a single-worker run; ``shared`` a run of the cluster's number of workers on
    the machine (``per_rank``: one entry each), whose per-phase medians over the single run's
    are the slow-down of sharing the cores (communication waits are a phase of their own and
    left out). The codecs slow down as backward does.

    Returns:
        the compute, and the slow-down factor per phase.
    """
    alone, together = _phases(single), _phases(shared)
    factors = {k: together[k] / alone[k] if alone[k] > 0 else 1.0 for k in alone}
    base = compute_from_report(single)
    compute = Compute(forward_s=base.forward_s * factors["forward"], backward_s=base.backward_s * factors["backward"],
                      optimizer_s=base.optimizer_s * factors["optim"], data_s=base.data_s * factors["data"],
                      codec_scale=factors["backward"], alone_step_s=base.step_s,
                      source=f"measured: single-worker run x the slow-down of {len(shared['per_rank'])} "
                             "workers on this machine")
    return compute, factors


def host_link(shared: dict[str, Any]) -> Link:
    """The machine's own all-reduce among the workers of ``shared`` (a run of the emulated
    cluster's number of workers on this machine, no shaped links), as a ring link.

    The run's gradient bytes (``comm_raw_bytes_per_step``) and the seconds a bucket was in
    flight (``comm_busy_s_per_step``) give one size, so ``α = 0`` and
    ``1/β = 2(n-1)/n raw / busy``: what copying and reducing through gloo costs when the
    workers share the machine's cores while the others compute. On the emulated cluster no
    collective is faster than this, whatever its link (see :func:`capped`).

    Raises:
        ValueError: the run has a single worker or no measured communication.
    """
    n = int(shared["world_size"])
    raw, busy = float(shared.get("comm_raw_bytes_per_step") or 0.0), float(shared.get("comm_busy_s_per_step") or 0.0)
    if n < 2 or not raw > 0 or not busy > 0:
        raise ValueError(f"a host link needs a run of >= 2 workers with communication, got {n} workers, "
                         f"{raw:g} bytes in {busy:g} s per step")
    return Link(0.0, 2 * (n - 1) / n * raw / busy)


def capped(link: Link, host: Link) -> Link:
    """``link`` no faster than ``host``: the larger latency and the smaller bandwidth."""
    return Link(max(link.latency_s, host.latency_s), min(link.bandwidth_bytes_per_s, host.bandwidth_bytes_per_s))


def sharing_s(shared: dict[str, Any], compute: Compute) -> float:
    """The wait per step of workers sharing the machine's cores (``Compute.sharing_s``): the
    measured step of ``shared`` (its ``median_step_s``: the median over steps of the slowest
    rank's, as the validation measures a job) less its compute phases (``compute``, from the
    same run: ``shared_compute``). Never negative.

    With more workers than cores the workers are time-sliced: they reach each collective at
    different times, the first waits for the last and the slowest sets the step. The local
    run has no shaped link, so this is everything its collectives and that skew cost."""
    return max(0.0, float(shared["median_step_s"]) - compute.step_phases_s)


def compute_from_profile(profile: dict[str, Any], *, micro_batches: int = 1, optimizer_s: float = 0.0) -> Compute:
    """Compute from a layer profile (``LayerProfile.as_dict()``, e.g. ``poise pipeline``'s
    report.json ``profile``): forward and backward summed over layers, times ``micro_batches``."""
    forward = sum(profile["forward_s"]) * micro_batches
    total = sum(profile["time_s"]) * micro_batches
    return Compute(forward_s=forward, backward_s=max(0.0, total - forward), optimizer_s=optimizer_s,
                   source=f"measured: layer profile of {len(profile['time_s'])} layers x {micro_batches} micro-batches")


def codec_speeds_from_kernels(kernels: Sequence[dict[str, Any]], mbytes: float, *, powersgd_rank: int = 8
                              ) -> dict[str, CodecSpeed]:
    """Encode/decode seconds per gradient byte from ``poise bench codecs``' kernel rows
    (``encode_ms``, ``decode_ms`` on an ``mbytes`` MB gradient). PowerSGD's matrix products
    grow with the rank: its row (measured at the rank in its options) is scaled to ``powersgd_rank``."""
    nbytes = mbytes * 1e6
    speeds = {}
    for row in kernels:
        name = row["codec"]
        if name.endswith("-exact"):
            continue
        factor = 1.0
        if name == "powersgd":
            factor = powersgd_rank / float(row.get("options", {}).get("rank", 4))
        speeds[name] = CodecSpeed(row["encode_ms"] * 1e-3 / nbytes * factor, row["decode_ms"] * 1e-3 / nbytes * factor,
                                  source=f"measured: poise bench codecs, {mbytes:g} MB"
                                  + (f" (rank {row.get('options', {}).get('rank', 4)} scaled to {powersgd_rank})"
                                     if factor != 1.0 else ""))
    return speeds


def codec_speeds(measured: dict[str, dict[str, float]], source: str = "measured: error feedback around the codec, "
                 "the model's buckets, one thread") -> dict[str, CodecSpeed]:
    """:class:`CodecSpeed` per codec from ``{name: {encode_s_per_byte, decode_s_per_byte}}``."""
    return {name: CodecSpeed(v["encode_s_per_byte"], v["decode_s_per_byte"], source) for name, v in measured.items()}
