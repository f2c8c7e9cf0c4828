"""poise: balanced, communication-efficient distributed training on torch.distributed.

The public API lives in the subpackages: ``poise.balance`` (samplers, planner, the balance
metric) and ``poise.comm`` (DDP communication hooks). See the README for the command line.
"""

from poise.config import RunConfig

__all__ = ["RunConfig"]
__version__ = "0.1.0"
