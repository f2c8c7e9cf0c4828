"""How ranks synchronize: one :class:`Sync` interface, called by the step at fixed points
(``poise/sync/base.py``; ``docs/design.md``), and its implementations."""

from poise.sync.allreduce import AllReduce
from poise.sync.base import Sync
from poise.sync.deadline import Deadline
from poise.sync.outer import Outer
from poise.sync.sharded import Sharded

__all__ = ["AllReduce", "Deadline", "Outer", "Sharded", "Sync"]
# the comparison baselines (--sync torch-localsgd, torchft-diloco; torchft is imported only when used)
from poise.sync.torch_localsgd import TorchLocalSGD
from poise.sync.torchft_diloco import TorchftDiLoCo

__all__ += ["TorchLocalSGD", "TorchftDiLoCo"]
