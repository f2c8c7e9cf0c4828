"""Who gets which work: cost functions, the shard planner, samplers, packed rows, re-planning,
exact loss weights for unequal batches, pipeline stage partitioning and layer profiling, the balance metric."""

from poise.balance.costs import AttentionCost, as_cost_fn, linear_cost
from poise.balance.metrics import balance, balance_ceiling, idle_fraction
from poise.balance.packed_sampler import PackedBatchSampler
from poise.balance.partition import PlanSummary, describe_plan, partition, stage_times
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.sampler import BalancedBatchSampler, make_sampler
from poise.balance.stage_count import recommend
from poise.balance.static_schedule import StaticSchedule
from poise.balance.weights import loss_weight

__all__ = [
    "AttentionCost",
    "BalancedBatchSampler",
    "DynamicPartitioner",
    "PackedBatchSampler",
    "PlanSummary",
    "StaticSchedule",
    "as_cost_fn",
    "balance",
    "balance_ceiling",
    "describe_plan",
    "idle_fraction",
    "linear_cost",
    "loss_weight",
    "make_sampler",
    "partition",
    "recommend",
    "stage_times",
]
