"""This machine's workers, started through torch's elastic launcher in-process.

The launcher is torch.distributed.run (the code behind ``torchrun``), called with the same
arguments a user would type: standalone rendezvous on one machine, or
``--nnodes/--node-rank/--rdzv-endpoint`` for multi-node jobs (the emulated cluster's agents,
:mod:`poise.cluster.agent`, pass those). Every worker runs :data:`WORKER_MODULE` on the
resolved ``config.toml`` unless told otherwise. When a worker fails, the launcher stops the
others and we return 1 after naming the rank whose failure caused the others, and its error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from poise.config import DistConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "poise.runtime.worker"


def launcher_args(dist: DistConfig, config_path: Path | None, module: str = WORKER_MODULE,
                  module_args: Sequence[str] | None = None) -> list[str]:
    """torchrun arguments for one machine's agent (what a user would type after ``torchrun``).

    The workers run ``python -m module --config config_path``, or ``module *module_args``
    when given (``poise diagnose``, whose workers take their own options).

    Raises:
        ValueError: ``dist.nnodes`` is not 1 and there is no ``dist.rdzv_endpoint``.
    """
    args = [f"--nproc-per-node={dist.nproc}", f"--nnodes={dist.nnodes}", f"--max-restarts={dist.max_restarts}",
            "--monitor-interval=0.5"]
    if dist.rdzv_endpoint:
        args += [f"--rdzv-backend={dist.rdzv_backend}", f"--rdzv-endpoint={dist.rdzv_endpoint}",
                 f"--rdzv-id={dist.rdzv_id}"]
        if dist.node_rank is not None:
            args.append(f"--node-rank={dist.node_rank}")
        if dist.local_addr:
            args.append(f"--local-addr={dist.local_addr}")
        if dist.rdzv_is_host is not None:
            args.append(f"--rdzv-conf=is_host={int(dist.rdzv_is_host)}")
    elif dist.nnodes != "1":
        raise ValueError(f"dist.nnodes={dist.nnodes!r} needs dist.rdzv_endpoint=HOST:PORT for the rendezvous")
    else:
        args.append("--standalone")
    return [*args, "-m", module, *(module_args if module_args is not None else ["--config", str(config_path)])]


def launch(dist: DistConfig, config_path: Path | None, *, module: str = WORKER_MODULE, command: str = "train",
           module_args: Sequence[str] | None = None) -> int:
    """Run this machine's workers of ``module`` through torch.distributed.run; returns 0 or 1 (a
    worker failed). ``command`` names the ``poise`` subcommand in the failure message;
    ``module_args`` replace ``--config config_path`` (see :func:`launcher_args`).
    """
    # torch is imported only when a job starts, not for ``poise --help``
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    # torchrun would force 1 thread per worker and warn; the worker sets its own count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if dist.socket_ifname:
        # Without it gloo binds to the address the hostname resolves to, which may be loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = dist.socket_ifname
    argv = launcher_args(dist, config_path, module, module_args)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = root_failure(exc)
        sys.stderr.write(
            f"poise {command}: rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}\n"
        )
        return 1
    return 0


# a rank's error that only reports that a peer went away: a consequence, not a cause
PEER_LOST = re.compile(r"connection (reset|closed) by peer|read error|broken pipe", re.IGNORECASE)


def root_failure(exc: Any) -> tuple[int, Any]:
    """The failure that caused the others: a rank killed by SIGKILL first, then by another signal
    than the launcher's own SIGTERM, then one whose error is not a peer's loss, then the first.

    A worker that is killed writes no error record, so torchelastic stamps its failure only
    when it notices it; by then a peer may have failed with "connection closed by peer" (as
    an exception, or aborting inside gloo) and been stamped earlier: a consequence, not the cause.
    Returns the global rank and its torchelastic ``ProcessFailure``.
    """
    def order(item: tuple[int, Any]) -> tuple[bool, bool, bool, float]:
        failure = item[1]
        signalled = failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
        return (failure.exitcode != -signal.SIGKILL, not signalled, bool(PEER_LOST.search(str(failure.message))),
                failure.timestamp)

    return min(exc.failures.items(), key=order)


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
