"""poise: balanced, communication-efficient distributed training on torch.distributed.

The public API is small on purpose; see the README for the command line.
"""

from poise.balance.metrics import balance
from poise.config import RunConfig

__all__ = ["RunConfig", "balance"]
__version__ = "0.1.0"
