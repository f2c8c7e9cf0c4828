"""Deadline steps: micro-batches until a shared deadline, an exact mean over what was computed."""

from poise.sync.deadline.runner import DeadlineRunner, NoPauses, Pauses, StepPlan
from poise.sync.deadline.strategy import Deadline, zero_backward

__all__ = ["Deadline", "DeadlineRunner", "NoPauses", "Pauses", "StepPlan", "zero_backward"]
