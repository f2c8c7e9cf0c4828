"""From a layer profile to a stage plan with its predictions (pure: every rank computes the same).

A :class:`StagePlan` holds the boundaries chosen by :func:`poise.balance.partition`, the
predicted seconds of each stage per step (compute alone, which is what the runner measures,
and with the modelled communication, which is what the plan minimised), the bubble fraction
and the stage / micro-batch advice (:func:`poise.balance.stage_count.recommend`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from poise.balance.metrics import balance
from poise.balance.partition import describe_plan, partition
from poise.balance.profile import LayerProfile
from poise.balance.stage_count import bubble_fraction, recommend


@dataclass(frozen=True)
class StagePlan:
    """A pipeline plan and what it predicts.

    Attributes:
        method: the partition method that chose the boundaries.
        boundaries: stage boundary offsets into the layer list, length ``num_stages + 1``.
        stage_layers: the layer names of each stage.
        compute_s: predicted compute seconds of each stage per step (all micro-batches).
        compute_balance: balance of ``compute_s``: what the measured balance is compared with.
        stage_s: ``compute_s`` plus each stage's modelled communication per step, seconds.
        bottleneck_s: the largest of ``stage_s``.
        bubble_fraction: (p − 1) / (m + p − 1) for this schedule's shape.
        advice: recommended stages / micro-batches and what limits them.
    """

    method: str
    boundaries: list[int]
    stage_layers: list[list[str]]
    compute_s: list[float]
    compute_balance: float
    stage_s: list[float]
    bottleneck_s: float
    bubble_fraction: float
    advice: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan_stages(
    profile: LayerProfile,
    num_stages: int,
    *,
    method: str,
    num_micro_batches: int,
    batch_size: int,
    in_flight_micro_batches: int,
    link_bytes_per_s: float = 0.0,
    memory_cap_bytes: float = 0.0,
) -> StagePlan:
    """Split the profiled layers into ``num_stages`` stages for one step of ``num_micro_batches``.

    Args:
        profile: per-layer costs of one micro-batch.
        num_stages: stages (one per worker).
        method: a :data:`poise.balance.partition.METHODS` name (``parameters`` uses parameter bytes).
        num_micro_batches: micro-batches per step; per-step seconds are per-micro-batch × this.
        batch_size: samples per step (limits the micro-batch advice).
        in_flight_micro_batches: activations a stage keeps at once (GPipe: m; 1F1B: up to p).
        link_bytes_per_s: bandwidth between stages for the communication cost (0 = free).
        memory_cap_bytes: most bytes one stage may hold (0 = no cap; exact only).
    """
    costs = [t * num_micro_batches for t in profile.time_s]
    comm = None
    if link_bytes_per_s > 0:
        comm = [s * num_micro_batches for s in profile.boundary_costs_s(link_bytes_per_s)]
    memory = profile.memory_bytes(micro_batches_in_flight=in_flight_micro_batches) if memory_cap_bytes else None
    kwargs: dict[str, Any] = {}
    if method == "exact":
        kwargs = {"boundary_costs": comm, "memory": memory, "memory_cap": memory_cap_bytes or None}
    elif method == "parameters":
        kwargs = {"weights": profile.param_bytes}
    boundaries = partition(costs, num_stages, method=method, **kwargs)
    compute = describe_plan(costs, boundaries)
    full = describe_plan(costs, boundaries, boundary_costs=comm)
    total_comp = sum(costs)
    widest_cut = max(comm) if comm else 0.0
    advice = recommend(t_comp_s=total_comp, t_comm_s=widest_cut, num_layers=len(costs),
                       max_stages=max(num_stages, 1), batch_size=batch_size)
    return StagePlan(
        method=method,
        boundaries=boundaries,
        stage_layers=[profile.names[a:b] for a, b in itertools.pairwise(boundaries)],
        compute_s=compute.stage_s,
        compute_balance=balance(compute.stage_s),
        stage_s=full.stage_s,
        bottleneck_s=full.bottleneck_s,
        bubble_fraction=bubble_fraction(num_stages, num_micro_batches),
        advice=dataclasses.asdict(advice),
    )
