"""Process-group set-up and teardown for workers started by torch's elastic launcher.

Workers never pick addresses or ports themselves: torch.distributed.run (torchrun) sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and we
initialise from them. Every wait has the configured timeout, so a dead peer becomes an
error instead of a hang, and the resolved config's hash is compared across ranks so that
workers that were handed different settings stop at once with a clear message.
"""

from __future__ import annotations

import atexit
import importlib
import ipaddress
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from poise.config import DistConfig, RunConfig, config_hash
from poise.runtime.launcher import MONITOR_INTERVAL_S, PEER_LOST, die_with_launcher, job_key

log = logging.getLogger(__name__)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Seconds to reach the store and meet the other ranks of an attempt (collectives use
# dist.timeout_s): short, so that a restart whose peers never come fails fast.
STORE_CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    store: dist.Store | None = None  # this attempt's key-value store (checkpoint completion notes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def restart_count() -> int:
    """How many times the launcher has restarted the workers (0 in the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resolve_backend(name: str) -> str:
    """``auto`` means NCCL when CUDA is present, gloo otherwise."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("dist.backend='nccl' needs CUDA, which this machine lacks: use 'gloo' or 'auto'")
    return name


def init_from_env(config: DistConfig) -> DistContext:
    """Join the process group described by the launcher's environment variables.

    Raises:
        ValueError: when not started by torchrun / ``poise train`` (variables missing).
    """
    die_with_launcher()  # before anything is written: a worker never outlives the poise command
    missing = [v for v in _LAUNCHER_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"environment variables {', '.join(missing)} are not set: start workers with "
            "'poise train' or 'torchrun ... -m poise.train.worker --config FILE'"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = resolve_backend(config.backend)
    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    store = job_store(rank, config)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=config.timeout_s)
    )
    ctx = DistContext(rank, world_size, local_rank, local_world_size, backend, device, store)
    log.info("process group up: %d ranks, backend %s, device %s", world_size, backend, device)
    return ctx


def job_store(rank: int, config: DistConfig) -> dist.Store:
    """The key-value store this attempt's process group meets in.

    After torchrun restarts the workers, a plain ``env://`` re-initialisation was unreliable
    here: the launcher's store still holds the dead attempt's worker addresses, and new
    workers could pick them up (in 13 tries: 5 recovered at once, 4 needed more restarts,
    3 ran out of restarts, 1 hung). So we connect to the store ourselves and put every key
    of this attempt under a prefix named after ``TORCHELASTIC_RESTART_COUNT``: an attempt
    can only ever see its own keys. The connection has a short timeout, so a peer that never
    arrives fails the attempt quickly and the launcher can try again.

    Under torchrun the store server is the launcher's (``TORCHELASTIC_USE_AGENT_STORE``);
    without it (``poise train`` on one machine, or a plain launcher setting
    ``MASTER_ADDR``/``MASTER_PORT``) rank 0 hosts it, on loopback only when ``MASTER_ADDR`` is
    a loopback address (:func:`loopback_listener`).
    """
    attempt = restart_count()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    connect_s = min(config.timeout_s, STORE_CONNECT_TIMEOUT_S)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    is_master = not agent_store and rank == 0
    store = dist.TCPStore(
        host, port, int(os.environ["WORLD_SIZE"]), is_master=is_master, timeout=timedelta(seconds=connect_s),
        wait_for_workers=False, master_listen_fd=loopback_listener(host, port) if is_master else None,
    )
    # under the job's secret when the launcher gave one: keys no other user can name
    key = job_key()
    return dist.PrefixStore(f"poise/{key + '/' if key else ''}attempt-{attempt}/", store)


def loopback_listener(host: str, port: int) -> int | None:
    """A listening socket on ``host:port`` for a TCPStore server to adopt when ``host`` is a
    loopback address (its fd), else None: a server of its own binds every interface."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1" if host == "localhost" else host, port))
    sock.listen(128)
    return sock.detach()


def check_config_agreement(config: RunConfig, ctx: DistContext) -> None:
    """Stop every rank when any rank was handed a different resolved config.

    Raises:
        ValueError: naming the ranks whose config hash differs from rank 0's.
    """
    digest = bytes.fromhex(config_hash(config))
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=ctx.device)
    rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(rows, mine)
    differ = [r for r, row in enumerate(rows) if not torch.equal(row, rows[0])]
    if differ:
        raise ValueError(
            f"ranks {differ} were started with a different config than rank 0: "
            "give every node the same config file and flags"
        )


def threads_for(config: RunConfig, local_world_size: int) -> int:
    """CPU threads per worker: the configured number, or this machine's cores shared evenly by
    its workers: ``local_world_size`` per node, and all nodes of an emulated cluster share it."""
    return config.dist.worker_threads(os.cpu_count() or 1, local_world_size * max(1, config.cluster.nodes))


def close(*, synchronize: bool) -> None:
    """Destroy the process group if one is up (safe to call twice).

    With ``synchronize`` (the normal end of a job) ranks first meet at a barrier: a rank that
    tears gloo down while a peer still talks to it can make the peer abort. After an error
    there is no barrier: the peers may be gone, and the launcher stops the job anyway.
    """
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


EXIT_WAIT_S = 10.0  # how long the rank that hosts the store waits at exit for the others' teardown
_CLOSE_AT_EXIT: list[bool] = []


def close_at_exit() -> None:
    """Destroy the process group when the interpreter exits normally, before it finalizes,
    in an order that cannot deadlock (idempotent; a script's own ``destroy_process_group``
    first makes it a no-op).

    Why: a gloo process group left to the interpreter's finalization still has worker threads
    that hold Python objects (the futures of DDP's comm hooks); destroying those while the
    interpreter is torn down can abort or hang the process after every output was written
    (pytorch/pytorch#190489). ``atexit`` runs while the interpreter is fully alive. And the
    rank whose process hosts the rendezvous store waits, at most ``EXIT_WAIT_S`` seconds, until
    every rank has destroyed its group: a rank slowed (a CPU quota) must not find the store gone
    mid-teardown.
    """
    if not _CLOSE_AT_EXIT:
        _CLOSE_AT_EXIT.append(True)
        atexit.register(_close_in_order)


def _close_in_order() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
    except (RuntimeError, ValueError):
        store = None
    dist.destroy_process_group()
    if store is None or world == 1:
        return
    try:
        store.add("poise/closed", 1)
        if rank == 0:
            deadline = time.monotonic() + EXIT_WAIT_S
            while store.add("poise/closed", 0) < world and time.monotonic() < deadline:
                time.sleep(0.05)
    except (RuntimeError, OSError):  # a peer or the store is gone already: nothing to wait for
        pass


_ON_EXIT: list[Callable[[], None]] = []


def on_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`exit_process`, before the process ends (``atexit`` handlers do not
    run there): what a worker set up for its own lifetime and must undo (an emulated slow
    rank's cgroup) registers here, so the exit path need not know what it is."""
    _ON_EXIT.append(fn)


def run_exit_hooks() -> None:
    """Run what was registered with :func:`on_exit`, newest first, once each."""
    while _ON_EXIT:
        _ON_EXIT.pop()()


def exit_process(code: int) -> None:
    """Flush logs and streams, then end the process with ``code`` and without C++ static
    destructors. Call it once everything is written (atomically, fsync'd) and the process group
    is gone (:func:`close`): with gloo, a background thread still alive when static destructors
    run intermittently aborts the process ("terminate called without an active exception"),
    which would turn a finished job into a failed one. ``atexit`` handlers do not run; those
    registered with :func:`on_exit` do, newest first."""
    run_exit_hooks()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_forked(module: str, *argv: str) -> int:
    """The workers' entry point when the launcher forks them (``dist.start_method`` fork): what
    ``python -m module ARGV`` runs, in a process that already holds torch and ``module``.

    A forked worker starts with its launcher's state, and is given what a new interpreter would
    have: default handlers for the signals torch's agent catches (the agent's own would raise
    its SignalException here), and the CPU threads that ``OMP_NUM_THREADS`` names, which torch
    read when the launcher imported it. It ends by returning to torch's agent (which waits for
    the value), after what the worker registered to undo at exit
    (:func:`on_exit`); the process then ends without C++ static destructors,
    as :func:`exit_process` ends a worker started as a new interpreter.
    """
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    try:
        return importlib.import_module(module).main(list(argv))
    except Exception as exc:
        if PEER_LOST.search(str(exc)):
            # Only a consequence: torch's agent names the first forked worker it finds failed
            # (torch.multiprocessing's join), polling every MONITOR_INTERVAL_S. Leaving two
            # polls later lets it find the rank that caused this one (killed, stopped or failed) first.
            time.sleep(2 * MONITOR_INTERVAL_S)
        raise
    finally:
        run_exit_hooks()
        sys.stdout.flush()
        sys.stderr.flush()
