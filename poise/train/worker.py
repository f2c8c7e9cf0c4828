"""The per-rank entry point of ``poise train``: ``torchrun ... -m poise.train.worker --config DIR/config.toml``.

``poise train`` starts this module through torch's elastic launcher; users can start it with a
plain ``torchrun`` just as well. It reads the resolved config, joins the process group and
runs :func:`poise.train.loop.train` (how a worker starts and ends: :mod:`poise.train.entry`).
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import record

from poise.train import entry
from poise.train.loop import train

# what the launcher imports before it forks the workers (poise.launch.elastic): DDP's constructor
# imports torch._dynamo, about 2.5 s of CPU in each worker otherwise
FORK_PRELOAD = ("torch._dynamo",)


@record
def main(argv: list[str] | None = None) -> int:
    """Worker entry point; errors propagate so torchrun reports them with this rank's traceback."""
    return entry.run_config_job(argv, "poise.train.worker", "train", train)


if __name__ == "__main__":
    entry.leave(main())
