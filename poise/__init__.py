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

import importlib
import pkgutil
import sys
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from poise.run.data import Data
    from poise.run.session import DeadlineStep, Session, Step

# last in line: an import of a module path that moved names where it is now (poise/config/former.py)
if not any(isinstance(finder, FormerModules) for finder in sys.meta_path):
    sys.meta_path.append(FormerModules())

# The API's classes, imported on first use (PEP 562): ``import poise`` alone, as the command
# line and a config read do, imports no torch (about 2 s on 2 cores), so ``poise train`` can
# resolve its config and refuse a bad flag first. Everything in this package's namespace is
# there once asked for, as when this module imported it all.
_LAZY = {"Data": "poise.run.data", "Session": "poise.run.session", "Step": "poise.run.session",
         "DeadlineStep": "poise.run.session"}
_SUBMODULES = frozenset(info.name for info in pkgutil.iter_modules(__path__))


def __getattr__(name: str) -> Any:
    """``poise.Session`` (and the other API classes), or a subpackage (``poise.balance``),
    imported when first asked for."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)


__all__ = ["BalanceConfig", "CommConfig", "Data", "DeadlineStep", "DiagnosticsConfig", "EmulateConfig",
           "MetricsConfig", "RunConfig", "Session", "Step", "StragglerConfig", "SyncConfig"]
__version__ = "0.2.0"  # pyproject.toml's version: the release CHANGELOG.md prepares
