"""How many pipeline stages and micro-batches: the bubble, the seed's N_opt rule, the advice.

Pure functions of a few numbers (seconds, counts); which layers go to which stage is
:mod:`poise.balance.partition`'s. With p stages and m micro-batches a GPipe or 1F1B step
idles (p − 1) / (m + p − 1) of its time (the bubble). The seed's rule N_opt =
⌈T_comp / T_comm⌉ + 1 gives a stage count from a step's compute and boundary-communication
seconds; :func:`recommend` caps it by layers, devices and memory, and takes the fewest
micro-batches that keep the bubble under a target, capped by the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Idle share of a GPipe/1F1B step: (p − 1) / (m + p − 1) for p stages, m micro-batches."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(
            f"num_stages={num_stages} and num_micro_batches={num_micro_batches} must both be >= 1"
        )
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def optimal_stage_count(t_comp_s: float, t_comm_s: float) -> int | None:
    """The seed's rule N_opt = ⌈T_comp / T_comm⌉ + 1; None when communication is free (T_comm = 0).

    Args:
        t_comp_s: compute seconds of one step of the whole model (forward + backward).
        t_comm_s: seconds to move one stage boundary's tensors for that step (both directions).
    """
    if not (math.isfinite(t_comp_s) and t_comp_s > 0) or not (math.isfinite(t_comm_s) and t_comm_s >= 0):
        raise ValueError(f"t_comp_s={t_comp_s!r} must be > 0 and t_comm_s={t_comm_s!r} >= 0 seconds")
    return None if t_comm_s == 0 else math.ceil(t_comp_s / t_comm_s) + 1


@dataclass(frozen=True)
class PipelineAdvice:
    """A recommended stage and micro-batch count, and what limited each.

    Attributes:
        num_stages: recommended stages.
        num_micro_batches: recommended micro-batches per step.
        n_opt: the seed's N_opt = ⌈T_comp / T_comm⌉ + 1 (None when communication is free).
        bubble_fraction: (p − 1) / (m + p − 1) for the recommendation.
        stages_limited_by: ``N_opt``, ``layers``, ``devices`` or ``memory``.
        micro_batches_limited_by: ``bubble target`` or ``batch size``.
    """

    num_stages: int
    num_micro_batches: int
    n_opt: int | None
    bubble_fraction: float
    stages_limited_by: str
    micro_batches_limited_by: str


def recommend(
    *,
    t_comp_s: float,
    t_comm_s: float,
    num_layers: int,
    max_stages: int,
    batch_size: int,
    min_stages: int = 1,
    bubble_target: float = 0.1,
) -> PipelineAdvice:
    """Recommend stages (N_opt, capped by layers and devices) and micro-batches (bubble target).

    Args:
        t_comp_s, t_comm_s: as in :func:`optimal_stage_count`.
        num_layers: layers (or inseparable units) available to split.
        max_stages: devices available.
        batch_size: samples per step; a micro-batch holds at least one.
        min_stages: fewest stages whose memory fits (e.g. the smallest p for which
            :func:`partition` meets the memory cap).
        bubble_target: largest acceptable bubble fraction, in (0, 1).
    """
    if not 0 < bubble_target < 1:
        raise ValueError(f"bubble_target={bubble_target} is outside (0, 1)")
    if min(num_layers, max_stages, batch_size, min_stages) < 1:
        raise ValueError(
            f"num_layers={num_layers}, max_stages={max_stages}, batch_size={batch_size} and "
            f"min_stages={min_stages} must all be >= 1"
        )
    n_opt = optimal_stage_count(t_comp_s, t_comm_s)
    limits = {"N_opt": n_opt if n_opt is not None else math.inf, "layers": num_layers, "devices": max_stages}
    limited_by = min(limits, key=lambda k: limits[k])
    stages = int(limits[limited_by])
    if stages < min_stages:
        if min_stages > min(num_layers, max_stages):
            raise ValueError(
                f"memory needs at least {min_stages} stages, but only {min(num_layers, max_stages)} are possible "
                f"({num_layers} layers, {max_stages} devices)"
            )
        stages, limited_by = min_stages, "memory"
    # smallest m with (p − 1) / (m + p − 1) <= target
    wanted = max(1, math.ceil((stages - 1) * (1 - bubble_target) / bubble_target - 1e-9))
    micro = min(wanted, batch_size)
    return PipelineAdvice(stages, micro, n_opt, bubble_fraction(stages, micro), limited_by,
                          "batch size" if micro < wanted else "bubble target")
