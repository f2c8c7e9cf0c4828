"""Who gets which work: cost functions, the shard planner, samplers, re-planning, the balance metric."""

from poise.balance.costs import AttentionCost, linear_cost
from poise.balance.metrics import balance, idle_fraction
from poise.balance.rebalance import DynamicPartitioner
from poise.balance.sampler import BalancedBatchSampler, StaticSchedule

__all__ = [
    "AttentionCost",
    "BalancedBatchSampler",
    "DynamicPartitioner",
    "StaticSchedule",
    "balance",
    "idle_fraction",
    "linear_cost",
]
