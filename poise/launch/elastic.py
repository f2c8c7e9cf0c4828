"""This machine's workers, started through torch's elastic launcher in-process.

The launcher is torch.distributed.run (the code behind ``torchrun``), called with the same
arguments a user would type: a rendezvous on this machine for one-machine jobs, or
``--nnodes/--node-rank/--rdzv-endpoint`` for multi-node jobs (the emulated cluster's agents,
:mod:`poise.launch.agent`, pass those).

A one-machine job listens on loopback only. ``--standalone`` would not do: its c10d store and
the agent's second, shared store bind every interface, unauthenticated, and gloo binds
whatever the hostname resolves to. So we host the rendezvous store here on a socket bound to
127.0.0.1 (:func:`loopback_rendezvous`) and tell the agent to join it as a client
(``--rdzv-conf=is_host=0``, ``--local-addr=127.0.0.1``); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``
stops the agent from starting its shared store, so the workers meet in rank 0's store, which
:func:`poise.runtime.dist.job_store` binds to loopback too; ``GLOO_SOCKET_IFNAME=lo`` (and
NCCL's) keeps the workers' own connections there. Multi-node jobs listen where the network is:
see the README on trusted networks and binding one interface (``--dist.socket_ifname``,
``--dist.local_addr``). Every worker runs :data:`WORKER_MODULE` on the
resolved ``config.toml`` unless told otherwise. When a worker fails, the launcher stops the
others and we return 1 after naming the rank whose failure caused the others, and its error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from poise.config import DistConfig

log = logging.getLogger(__name__)

WORKER_MODULE = "poise.train.worker"
LOOPBACK = "127.0.0.1"
# seconds the agent may take to reach the rendezvous store (torch's own default for c10d)
_RDZV_READ_TIMEOUT_S = 60


def launcher_args(dist: DistConfig, config_path: Path | None, module: str = WORKER_MODULE,
                  module_args: Sequence[str] | None = None, loopback_port: int | None = None) -> list[str]:
    """torchrun arguments for one machine's agent (what a user would type after ``torchrun``).

    The workers run ``python -m module --config config_path``, or ``module *module_args``
    when given (``poise diagnose``, whose workers take their own options). A one-machine job
    joins the loopback rendezvous store at ``loopback_port`` (see the module doc), or is
    ``--standalone`` without one.

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
    elif loopback_port is not None:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{loopback_port}", f"--rdzv-id={uuid.uuid4()}",
                 f"--rdzv-conf=is_host=0,read_timeout={_RDZV_READ_TIMEOUT_S}", f"--local-addr={LOOPBACK}"]
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
    one_machine = not dist.rdzv_endpoint and dist.nnodes == "1"
    if dist.socket_ifname or one_machine:
        # Without it gloo binds to the address the hostname resolves to, which may be loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = dist.socket_ifname or "lo"
    if one_machine:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no second store on every interface
    try:
        with loopback_rendezvous() if one_machine else _no_store() as port:
            argv = launcher_args(dist, config_path, module, module_args, loopback_port=port)
            log.info("launching: torchrun %s", " ".join(argv))
            elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = root_failure(exc)
        sys.stderr.write(
            f"poise {command}: rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}\n"
        )
        return 1
    return 0


@contextmanager
def loopback_rendezvous() -> Iterator[int]:
    """Host a c10d rendezvous store in this process that listens on 127.0.0.1 only; yields its port.

    torch's TCPStore server binds every interface unless it is handed a listening socket
    (``master_listen_fd``): we bind one to loopback, with an OS-chosen port, and hand it over.
    """
    import torch.distributed as tdist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = tdist.TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=sock.detach(), multi_tenant=True,
                           wait_for_workers=False, timeout=timedelta(seconds=_RDZV_READ_TIMEOUT_S))
    try:
        yield port
    finally:
        del store


@contextmanager
def _no_store() -> Iterator[None]:
    yield None


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
