"""Who gets which work: cost functions, the shard planner, samplers, re-planning, pipeline stage
partitioning and layer profiling, the balance metric."""

from poise.balance.costs import AttentionCost, linear_cost
from poise.balance.metrics import balance, idle_fraction
from poise.balance.partition import PlanSummary, describe_plan, partition, recommend, stage_times
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.sampler import BalancedBatchSampler, StaticSchedule

__all__ = [
    "AttentionCost",
    "BalancedBatchSampler",
    "DynamicPartitioner",
    "PlanSummary",
    "StaticSchedule",
    "balance",
    "describe_plan",
    "idle_fraction",
    "linear_cost",
    "partition",
    "recommend",
    "stage_times",
]
