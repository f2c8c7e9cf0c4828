"""Starting workers with torch's elastic launcher, shared by every command that runs a job.

The launcher is torch.distributed.run (the code behind ``torchrun``), called in-process with
the same arguments a user would type: standalone rendezvous on one machine, or
``--nnodes/--node-rank/--rdzv-endpoint`` for multi-node jobs. When a worker fails, the
launcher stops the others and we exit non-zero naming the failed rank and its error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence

from poise.config import DistConfig

log = logging.getLogger(__name__)


def launcher_args(d: DistConfig, module: str, module_args: Sequence[str]) -> list[str]:
    """torchrun arguments that run ``python -m module *module_args`` on every worker."""
    args = [f"--nproc-per-node={d.nproc}", f"--nnodes={d.nnodes}", "--max-restarts=0", "--monitor-interval=0.5"]
    if d.rdzv_endpoint:
        args += [f"--rdzv-backend={d.rdzv_backend}", f"--rdzv-endpoint={d.rdzv_endpoint}", f"--rdzv-id={d.rdzv_id}"]
        if d.node_rank is not None:
            args.append(f"--node-rank={d.node_rank}")
    elif d.nnodes != "1":
        raise ValueError(f"dist.nnodes={d.nnodes!r} needs dist.rdzv_endpoint=HOST:PORT for the rendezvous")
    else:
        args.append("--standalone")
    return [*args, "-m", module, *module_args]


def launch(d: DistConfig, module: str, module_args: Sequence[str], command: str) -> int:
    """Run ``module`` on the workers through torch.distributed.run; returns 0, or 1 when a
    worker failed (its rank and error line written to stderr, prefixed with ``command``)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    # torchrun would force 1 thread per worker and warn; workers set their own count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = launcher_args(d, module, module_args)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        sys.stderr.write(
            f"{command}: rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}\n"
        )
        return 1
    return 0


def _error_line(message: object) -> str:
    """The exception line from a torchelastic failure message (a JSON error record when the
    worker used ``@record``, plain text otherwise)."""
    if isinstance(message, str):
        try:
            message = json.loads(message)
        except ValueError:
            pass
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip()
    return text.splitlines()[0] if text else "(no message)"
