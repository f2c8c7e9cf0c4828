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
A worker whose process is stopped is ended by :mod:`poise.launch.watchdog` after a few
seconds, and named as having stopped responding.

How the workers start (``dist.start_method``, :func:`start_method`): a new interpreter each
(``python -m MODULE``, torchrun's way with a module), or forked from this process, which
imported torch and the worker's module once (torchrun's function entry point with its
``fork`` start method): a worker then starts in milliseconds instead of importing torch,
poise and torch._dynamo again (about 7 s of CPU each on this project's 2-core test machine).
Forking is chosen only where it is safe: torch's CUDA runtime cannot be used in a process
forked after the parent touched it, and OpenMP's thread pool, once started in the parent,
hangs a forked child's first parallel region with more than one thread (measured with torch
2.13's libgomp); so ``auto`` forks only where torch has no GPU build and each worker uses one
CPU thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
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
from poise.runtime.launcher import JOB_KEY_ENV, LAUNCHER_PID_ENV, MONITOR_INTERVAL_S, PEER_LOST

log = logging.getLogger(__name__)

WORKER_MODULE = "poise.train.worker"
LOOPBACK = "127.0.0.1"
# seconds the agent may take to reach the rendezvous store (torch's own default for c10d)
_RDZV_READ_TIMEOUT_S = 60
# a worker stopped this long (at most half the collective timeout) is ended by the watchdog: a
# training process is never stopped on purpose for seconds (a debugger's stop is state 't', not
# 'T'), and every second here is a second all the other workers wait
STOPPED_GRACE_S = 2.0
# a collective that timed out, as gloo words it ("Timed out waiting 8000ms for recv operation")
# and c10d's store ("... timeout ..."): the rank waited for a peer
TIMED_OUT = re.compile(r"timed out waiting (\d+)\s*ms for (\w+)|timed out|timeout", re.IGNORECASE)


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
            f"--monitor-interval={MONITOR_INTERVAL_S}"]
    if dist.rdzv_endpoint:
        args += [f"--rdzv-backend={dist.rdzv_backend}", f"--rdzv-endpoint={dist.rdzv_endpoint}",
                 f"--rdzv-id={dist.rdzv_id}"]
        if dist.node_rank is not None:
            args.append(f"--node-rank={dist.node_rank}")
        if dist.local_addr:
            args.append(f"--local-addr={dist.local_addr}")
        conf = [f"is_host={int(dist.rdzv_is_host)}"] if dist.rdzv_is_host is not None else []
        conf += [item.replace(" ", "") for item in dist.rdzv_conf.split(",") if item.strip()]
        if conf:
            args.append(f"--rdzv-conf={','.join(conf)}")
    elif dist.nnodes != "1":
        raise ValueError(f"dist.nnodes={dist.nnodes!r} needs dist.rdzv_endpoint=HOST:PORT for the rendezvous")
    elif loopback_port is not None:
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{loopback_port}", f"--rdzv-id={uuid.uuid4()}",
                 f"--rdzv-conf=is_host=0,read_timeout={_RDZV_READ_TIMEOUT_S}", f"--local-addr={LOOPBACK}"]
    else:
        args.append("--standalone")
    return [*args, "-m", module, *(module_args if module_args is not None else ["--config", str(config_path)])]


def fork_risk(dist: DistConfig, gpu_build: bool, cores: int) -> str:
    """Why forking this machine's workers is unsafe (see the module doc), '' when it is safe:
    ``gpu_build``: torch was built with CUDA or ROCm; ``cores``: this machine's CPU cores, shared
    by its ``dist.nproc`` workers (:meth:`~poise.config.DistConfig.worker_threads`)."""
    if gpu_build:
        return "torch has a GPU build, whose runtime a forked worker cannot use once the launcher did"
    threads = dist.worker_threads(cores, dist.nproc)
    if threads > 1:
        return (f"{threads} CPU threads per worker: OpenMP's pool does not survive a fork "
                "(dist.threads_per_worker=1 or more workers would allow it)")
    return ""


def start_method(setting: str, risk: str) -> tuple[str, str]:
    """How the workers start, ``fork`` or ``subprocess``, and why: ``setting``
    (``dist.start_method``) unless auto, which forks where :func:`fork_risk` found no ``risk``."""
    if setting != "auto":
        return setting, "as set (dist.start_method)"
    if risk:
        return "subprocess", risk
    return "fork", "torch has no GPU build and each worker uses one CPU thread"


def launch(dist: DistConfig, config_path: Path | None, *, module: str = WORKER_MODULE, command: str = "train",
           module_args: Sequence[str] | None = None) -> int:
    """Run this machine's workers of ``module`` through torch.distributed.run; returns 0 or 1 (a
    worker failed). ``command`` names the ``poise`` subcommand in the failure message;
    ``module_args`` replace ``--config config_path`` (see :func:`launcher_args`).
    """
    # torch is imported only when a job starts, not for ``poise --help``
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    from poise.launch.watchdog import StoppedWorkerWatchdog

    # torchrun would force 1 thread per worker and warn; the worker sets its own count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the workers die with this process, even when it is killed outright (poise.runtime.launcher)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    one_machine = not dist.rdzv_endpoint and dist.nnodes == "1"
    if dist.socket_ifname or one_machine:
        # Without it gloo binds to the address the hostname resolves to, which may be loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = dist.socket_ifname or "lo"
    if one_machine:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no second store on every interface
        # the job's secret (poise.runtime.launcher): its store keys and checkpoint token; the
        # nodes of a multi-node job have no way to share one, and listen on a trusted network
        os.environ[JOB_KEY_ENV] = secrets.token_hex(16)
    else:
        os.environ.pop(JOB_KEY_ENV, None)
    risk = fork_risk(dist, gpu_build=torch.version.cuda is not None or torch.version.hip is not None,
                     cores=os.cpu_count() or 1)
    how, why = start_method(dist.start_method, risk)
    if how == "fork" and risk:
        log.warning("workers forked as set (dist.start_method=fork), though %s: a worker may hang or fail; "
                    "dist.start_method=auto would start them as new interpreters here", risk)
    watchdog = StoppedWorkerWatchdog(grace_s=min(STOPPED_GRACE_S, dist.timeout_s / 2))
    try:
        with loopback_rendezvous() if one_machine else _no_store() as port, watchdog:
            argv = launcher_args(dist, config_path, module, module_args, loopback_port=port)
            log.info("launching (workers by %s: %s): torchrun %s", how, why, " ".join(argv))
            if how == "fork":
                _launch_forked(get_args_parser().parse_args(argv))
            else:
                elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        sys.stderr.write(f"poise {command}: {failure_line(exc, watchdog.ended)}\n")
        return 1
    except SignalException as exc:  # torch's agent turned SIGINT/SIGTERM into this, after stopping the workers
        name = signal.Signals(exc.sigval).name
        sys.stderr.write(f"poise {command}: stopped by {name}{' (Ctrl-C)' if exc.sigval == signal.SIGINT else ''}; "
                         "the workers are stopped\n")
        return 128 + int(exc.sigval)
    finally:
        _restore_signal_handlers()
    return 0


def _launch_forked(args: Any) -> None:
    """torch.distributed.run's launch of ``args`` (a ``-m MODULE ...`` command line), with the
    workers forked from this process into :func:`~poise.runtime.dist.run_forked` instead of
    started as new interpreters. The module is imported here first, with what it names in its
    ``FORK_PRELOAD`` (modules it imports later, at a cost to every worker), so that every worker holds them."""
    import importlib

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from poise.runtime.dist import run_forked

    config, _, cmd_args = config_from_args(args)
    config.start_method = "fork"
    module, *argv = cmd_args[cmd_args.index("-m") + 1:]
    for name in (module, *getattr(importlib.import_module(module), "FORK_PRELOAD", ())):
        importlib.import_module(name)
    sys.stdout.flush()  # what a child would otherwise write a second time
    sys.stderr.flush()
    elastic_launch(config, entrypoint=run_forked)(module, *argv)


def _restore_signal_handlers() -> None:
    """Put back Python's own handlers where torch's agent installed its (which raise
    SignalException), so that a second Ctrl-C while the command ends is an ordinary interrupt."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def failure_line(exc: Any, stopped: Sequence[Any] = ()) -> str:
    """What to tell the user about a failed attempt (after ``poise COMMAND: ``): the rank whose
    failure caused the others, and how.

    ``stopped``: the workers :mod:`poise.launch.watchdog` ended (the newest last): one of the
    failed ranks was stopped, not killed. A rank whose collective timed out before any rank was
    SIGKILLed waited for a peer that stopped responding (the SIGKILL was the agent's shutdown).
    """
    failed = dict(exc.failures)
    pids = {failure.pid for failure in failed.values()}
    ended = [w for w in stopped if w.pid in pids]
    if ended:
        worker = ended[-1]
        return (f"rank {worker.rank} stopped responding: its process was stopped (SIGSTOP?) for "
                f"{worker.stopped_s:.0f} s while its peers waited in their collectives; the launcher's "
                "watchdog ended it")
    waited = timed_out_first(exc)
    if waited is not None:
        who, what = waited
        match = TIMED_OUT.search(str(what.message))
        how = f" after {int(match.group(1)) / 1000:g} s in a {match.group(2)}" if match and match.group(1) else ""
        killed = [r for r, f in failed.items() if f.exitcode == -signal.SIGKILL]
        return (f"rank {who} timed out{how} waiting for its peers: rank(s) {killed or '?'} stopped responding "
                f"(ended by the launcher afterwards): {_error_line(what.message)}")
    rank, failure = root_failure(exc)
    return f"rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}"


def timed_out_first(exc: Any) -> tuple[int, Any] | None:
    """The rank whose collective timed out, when that came before every SIGKILL among the
    failures (a peer stopped responding and was killed later, by the agent); else None."""
    timed_out = [(r, f) for r, f in exc.failures.items() if TIMED_OUT.search(str(f.message))]
    if not timed_out:
        return None
    first = min(timed_out, key=lambda item: item[1].timestamp)
    killed = [f.timestamp for f in exc.failures.values() if f.exitcode == -signal.SIGKILL]
    return first if killed and min(killed) > first[1].timestamp else None


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
