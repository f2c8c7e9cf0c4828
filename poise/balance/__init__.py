"""Who gets which work: the balance metric and the data samplers."""

from poise.balance.metrics import balance, idle_fraction

__all__ = ["balance", "idle_fraction"]
