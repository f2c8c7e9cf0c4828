"""Every configuration poise offers, predicted; the recommendation; the heavy parameter blocks.

:func:`plan_all` predicts a step (``step_time.py``) for each codec × collective × bucket size;
:func:`recommend` picks the fastest whose measured accuracy cost is within a budget (a codec
whose cost is unknown is only recommended when no budget is given; ``none`` costs nothing),
and among configurations predicted within :data:`TIE_MARGIN` of it the simplest;
:func:`heavy_params` names the parameter tensors that carry most of the gradient bytes, with
advice by kind (the seed's §5.2: place or compress the big blocks such as the embedding,
prefer attention that splits across ranks, MoE for balance). Pure functions of numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from poise.plan.costs import Cluster
from poise.plan.step_time import CodecSpeed, Compute, Param, StepConfig, predict_step

# the codecs and options the planner compares (poise's defaults), and what it sweeps
CODEC_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {}, "fp16": {}, "bf16": {}, "int8": {}, "sign": {}, "topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01},
    "powersgd": {"rank": 8},
}
COLLECTIVES = ("flat", "ring", "tree", "hierarchical")
BUCKET_MB = (1.0, 5.0, 25.0, 100.0)
# assumed memory passes per fp32 gradient byte (encode, decode) of each codec's kernels, for a
# device where poise bench codecs has not measured them: elementwise casts read 4 and write 2
# bytes per entry; top-k samples a threshold and scans; PowerSGD reads the gradient twice
MEMORY_PASSES: dict[str, tuple[float, float]] = {
    "none": (0.0, 0.0), "fp16": (1.5, 1.5), "bf16": (1.5, 1.5), "int8": (1.3, 1.3), "sign": (1.05, 1.05),
    "topk": (2.0, 1.0), "randomk": (0.1, 1.0), "powersgd": (3.0, 1.0),
}


@dataclass(frozen=True)
class PlanRow:
    """One predicted configuration. Seconds per step, bytes per step and rank.

    Attributes:
        efficiency: one worker's step / this step (weak scaling: the same per-worker batch).
        speedup: ``world_size × efficiency``.
        loss_increase_pct: the codec's measured eval-loss increase over ``none`` (percent),
            None when unknown.
    """

    codec: str
    collective: str
    bucket_mb: float
    step_s: float
    exposed_comm_s: float
    codec_s: float
    wire_bytes: float
    inter_node_bytes: float
    num_buckets: int
    efficiency: float
    speedup: float
    loss_increase_pct: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def assumed_speeds(memory_bytes_per_s: float) -> dict[str, CodecSpeed]:
    """Codec seconds per byte from :data:`MEMORY_PASSES` at ``memory_bytes_per_s`` (assumed)."""
    return {name: CodecSpeed(enc / memory_bytes_per_s, dec / memory_bytes_per_s,
                             source=f"assumed: {enc:g}+{dec:g} passes over memory at {memory_bytes_per_s / 1e9:g} GB/s")
            for name, (enc, dec) in MEMORY_PASSES.items()}


def loss_costs_from_results(results: dict[str, Any]) -> dict[str, float]:
    """Percent eval-loss increase per codec from ``poise bench codecs``' JSON ``runs``: a spec
    counts for a codec when it sets no option or the planner's own options."""
    costs: dict[str, float] = {"none": 0.0}
    for row in results.get("runs", []):
        if "loss_delta_pct" not in row:
            continue
        name, _, opts = str(row["codec"]).partition(":")
        if name not in CODEC_OPTIONS:
            continue
        options = dict(kv.split("=", 1) for kv in opts.split(",") if "=" in kv)
        defaults = {k: float(v) for k, v in CODEC_OPTIONS[name].items()}
        if options and {k: float(v) for k, v in options.items()} != defaults:
            continue
        costs[name] = float(row["loss_delta_pct"])
    return costs


def plan_all(cluster: Cluster, params: Sequence[Param], compute: Compute, speeds: dict[str, CodecSpeed],
             loss_costs: dict[str, float] | None = None, *, codecs: Sequence[str] = tuple(CODEC_OPTIONS),
             collectives: Sequence[str] = COLLECTIVES, bucket_mb: Sequence[float] = BUCKET_MB) -> list[PlanRow]:
    """Every codec × collective × bucket size, fastest first."""
    costs = {"none": 0.0, **(loss_costs or {})}
    alone_s = compute.step_s
    rows = []
    for codec in codecs:
        for collective in collectives:
            for mb in bucket_mb:
                config = StepConfig(codec, collective, mb, CODEC_OPTIONS.get(codec, {}))
                p = predict_step(cluster, params, compute, config, speeds)
                efficiency = alone_s / p.step_s if p.step_s > 0 else 1.0
                rows.append(PlanRow(codec, collective, mb, p.step_s, p.exposed_comm_s, p.codec_s, p.wire_bytes,
                                    p.inter_node_bytes, p.num_buckets, efficiency, cluster.world_size * efficiency,
                                    costs.get(codec)))
    return sorted(rows, key=lambda r: r.step_s)


# A predicted gain smaller than this fraction is inside the model's error (its median |error|
# against measured jobs on the emulated cluster is about 5 %, see README): between such rows
# the simpler configuration is recommended (lossless before lossy codecs, flat before
# topology-aware collectives), since a gain that may not exist is not worth an accuracy risk.
TIE_MARGIN = 0.05
_CODEC_TIER = {"none": 0, "fp16": 1, "bf16": 1}  # uncompressed, casts; every other codec is lossy: tier 2
_COLLECTIVE_ORDER = ("flat", "ring", "tree", "hierarchical")

T = TypeVar("T")


def prefer_simple(rows: Sequence[T], seconds: Callable[[T], float], codec: Callable[[T], str],
                  collective: Callable[[T], str], margin: float = TIE_MARGIN) -> T | None:
    """The simplest of the rows predicted within ``margin`` of the fastest (see TIE_MARGIN):
    uncompressed, then casts, then lossy codecs (the fastest of those), each flat first; None
    for no rows."""
    if not rows:
        return None
    best = min(seconds(r) for r in rows)

    def simplicity(r: T) -> tuple[int, int, float]:
        k = collective(r)
        return (_CODEC_TIER.get(codec(r), 2),
                _COLLECTIVE_ORDER.index(k) if k in _COLLECTIVE_ORDER else len(_COLLECTIVE_ORDER), seconds(r))

    return min((r for r in rows if seconds(r) <= (1.0 + margin) * best), key=simplicity)


def recommend(rows: Sequence[PlanRow], max_loss_increase_pct: float | None = None,
              margin: float = TIE_MARGIN) -> PlanRow | None:
    """The fastest row within the loss budget (percent; None: any codec), the simplest among
    those within ``margin`` of it; None if none fits."""
    eligible = [r for r in rows if max_loss_increase_pct is None
                or (r.loss_increase_pct is not None and r.loss_increase_pct <= max_loss_increase_pct)]
    return prefer_simple(eligible, lambda r: r.step_s, lambda r: r.codec, lambda r: r.collective, margin)


_ADVICE = {
    "embedding": "place it where communication is cheap (shard the table inside a node, vocab-parallel) or "
                 "compress it: its gradient is row-sparse and its bucket comes last in backward, with nothing "
                 "left to overlap it",
    "head": "place or compress it (tie it to the embedding to halve these bytes); its bucket comes first in "
            "backward and overlaps the most",
    "attention": "prefer attention that splits across ranks (heads over the ranks of a node), so each rank "
                 "reduces only its share",
    "mlp": "a mixture of experts splits these bytes over experts and balances the load",
    "other": "a large block: compress it or keep it on the fast links",
}


def param_kind(name: str) -> str:
    """``embedding``, ``head``, ``attention``, ``mlp`` or ``other``, from a parameter's name."""
    lowered = name.lower()
    for kind, words in (("embedding", ("embed", "wte", "wpe", "tok")), ("head", ("head", "lm_", "output")),
                        ("attention", ("attn", "qkv", "query", "key", "value", "proj")),
                        ("mlp", ("mlp", "fc", "ffn", "feed"))):
        if any(w in lowered for w in words):
            return kind
    return "other"


def heavy_params(params: Sequence[Param], top: int = 5) -> list[dict[str, Any]]:
    """The ``top`` parameter tensors by gradient bytes (fp32), their share, kind and advice."""
    total = sum(p.numel for p in params) or 1
    ranked = sorted(params, key=lambda p: p.numel, reverse=True)[:top]
    return [{"name": p.name, "shape": list(p.shape), "bytes": 4 * p.numel, "share": p.numel / total,
             "kind": param_kind(p.name), "advice": _ADVICE[param_kind(p.name)]} for p in ranked]


def flops_compute(num_params: float, tokens_per_step: float, peak_flops: float, mfu: float,
                  optimizer_s: float = 0.0) -> Compute:
    """Compute from FLOPs (assumed): ``6 P tokens`` per step at ``mfu`` of ``peak_flops``;
    forward a third of it, backward two thirds."""
    total = 6 * num_params * tokens_per_step / (peak_flops * mfu)
    return Compute(total / 3, 2 * total / 3, optimizer_s, source=(
        f"assumed: 6 x {num_params:.3g} params x {tokens_per_step:g} tokens at {mfu:.0%} of {peak_flops:.3g} FLOP/s"))


def split_step(step_s: float, optimizer_s: float = 0.0) -> Compute:
    """A measured single-worker step split as forward 1/3, backward 2/3 of what the optimizer leaves (assumed split)."""
    rest = max(0.0, step_s - optimizer_s)
    return Compute(rest / 3, 2 * rest / 3, optimizer_s,
                   source=f"measured step {step_s:g} s (given); split forward 1/3, backward 2/3 (assumed)")


def layer_params(names: Sequence[str], param_bytes: Sequence[int], backward_s: Sequence[float]) -> list[Param]:
    """One near-square fp32 matrix per profiled layer (shapes assumed), its backward seconds as its share."""
    out = []
    for name, nbytes, b in zip(names, param_bytes, backward_s, strict=True):
        numel = max(1, int(nbytes) // 4)
        rows = max(1, math.isqrt(numel))
        out.append(Param(name, (rows, max(1, numel // rows)), max(0.0, b)))
    return out
