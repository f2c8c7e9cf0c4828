"""How ranks synchronize: one :class:`Sync` interface, called by the step at fixed points
(``poise/sync/base.py``; ``docs/design.md``), and its implementations.

:class:`Sharded` (FSDP2) is imported on first use: FSDP and DTensor take about 1 s to import
and a DDP job never needs them (``poise/runtime/fsdp.py``)."""

from typing import TYPE_CHECKING, Any

from poise.sync.allreduce import AllReduce
from poise.sync.base import Sync
from poise.sync.deadline import Deadline
from poise.sync.outer import Outer

if TYPE_CHECKING:
    from poise.sync.sharded import Sharded

__all__ = ["AllReduce", "Deadline", "Outer", "Sharded", "Sync"]
# the comparison baselines (--sync torch-localsgd, torchft-diloco; torchft is imported only when used)
from poise.sync.torch_localsgd import TorchLocalSGD
from poise.sync.torchft_diloco import TorchftDiLoCo

__all__ += ["TorchLocalSGD", "TorchftDiLoCo"]


def __getattr__(name: str) -> Any:
    """``poise.sync.Sharded``, imported when first asked for (see module doc)."""
    if name == "Sharded":
        from poise.sync.sharded import Sharded

        return Sharded
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
