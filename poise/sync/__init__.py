"""How ranks synchronize: one :class:`Sync` interface, called by the step at fixed points
(``poise/sync/base.py``; ``docs/design.md``), and its implementations."""

from poise.sync.allreduce import AllReduce
from poise.sync.base import Sync
from poise.sync.deadline import Deadline

__all__ = ["AllReduce", "Deadline", "Sync"]
