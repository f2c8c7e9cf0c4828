"""poise: balanced, communication-efficient distributed training on torch.distributed.

In your own training script, :class:`Session` is the whole API: it wraps your model in DDP
with poise's gradient codec and timing probe, gives your DataLoader a balanced batch sampler,
weights each step's loss so unequal batches give the exact gradient, measures every rank,
re-plans from measured speeds, bounds each step by a shared deadline under stragglers
(``straggler=``) or meets only every few steps (``sync=``: local SGD, DiLoCo), and writes
report.json, timeline.png and trace.json.
Adapters: ``poise.integrations.lightning`` and ``poise.integrations.accelerate``.

The pieces are public too: ``poise.balance`` (samplers, planner, the balance metric, stage
partitioning), ``poise.comm`` (codecs and DDP communication hooks) and ``poise.config`` (every
setting, typed and validated). The command line (``poise train``, ``poise bench``, ...) is
built on the same API.
"""

import sys

from poise.config import (
    BalanceConfig,
    CommConfig,
    DiagnosticsConfig,
    EmulateConfig,
    FormerModules,
    MetricsConfig,
    RunConfig,
    StragglerConfig,
    SyncConfig,
)
from poise.run.data import Data
from poise.run.session import DeadlineStep, Session, Step

# last in line: an import of a module path that moved names where it is now (poise/config/former.py)
if not any(isinstance(finder, FormerModules) for finder in sys.meta_path):
    sys.meta_path.append(FormerModules())

__all__ = ["BalanceConfig", "CommConfig", "Data", "DeadlineStep", "DiagnosticsConfig", "EmulateConfig",
           "MetricsConfig", "RunConfig", "Session", "Step", "StragglerConfig", "SyncConfig"]
__version__ = "0.2.0"  # pyproject.toml's version: the release CHANGELOG.md prepares
