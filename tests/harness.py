"""Spawn N real processes on gloo over loopback, bounded in time, tracebacks propagated.

``run_ranks(fn, world_size, timeout_s, **kwargs)`` starts ``world_size`` processes (spawn
context), each joining a gloo process group through a TCPStore that the parent owns on
127.0.0.1 with an OS-chosen port, runs ``fn(rank, world_size, **kwargs)`` and returns the
results in rank order. A child's exception reaches the test as
``torch.multiprocessing.ProcessRaisedException`` carrying the child's traceback; a world
still running at the deadline is killed and the test fails naming the ranks still alive.
``fn`` must be a module-level function (it is pickled by name).

The ranks start from a fork server that imported torch and poise once for the whole test session
(``forkserver`` with those modules preloaded): each world is still a set of new processes, with
nothing left over from an earlier test, but none of them imports torch again (seconds per rank
on a loaded 2-core machine, for each of the tier's ~80 worlds). A rank takes the parent's
environment as it is at the call (the fork server's is the one of its own start).

``run_cli(args, cwd=..., env=..., timeout_s=...)`` runs the ``poise`` command (or, with
``program="torchrun"``, torchrun) the same way: a process forked from that server runs
``poise.cli.main(args)`` with its own environment, working directory and output files, and
returns what ``subprocess.run`` would. Everything below the command is the real thing (torch's
elastic agent starting its workers, as the command would); only the command's own interpreter
start and imports (about 4 s of CPU per job, ~250 jobs in the e2e and docs tiers) are saved.
A user's script under ``torchrun`` runs whole in each worker, as ``python SCRIPT`` would run it;
its workers are forked by torchrun's own ``--run-path`` option, so that they hold the server's
imports (torch and the frameworks: Lightning alone is 6 s of CPU per worker started anew).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

# What the fork server imports before it forks a rank: what every world needs and is slow to import.
# torch._dynamo is imported by DDP's constructor (seconds of a rank's first DistributedDataParallel,
# 10 s on a loaded machine); pytest by every test module a rank unpickles its function from.
# poise's own modules load on first use (``import poise`` imports no torch): the session's are named.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.testing", "numpy", "pytest", "poise",
           "poise.cli", "poise.run.session", "poise.run.data", "tests.harness",
           # the frameworks of the e2e tier's scripts, which their forked workers (see _torchrun) would
           # otherwise import each (Lightning alone: 6 s of CPU); the server skips one not installed
           "lightning.pytorch", "accelerate", "transformers"]
_CONTEXT: Any = None


def _context() -> Any:
    """The forkserver context, its preload set before the server starts (at the first world)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def start_server() -> None:
    """Start the fork server now (its imports take ~15 s of CPU on this machine), not inside the
    first test that needs it: a test that times two jobs against each other would otherwise
    measure the server's start too."""
    warm = _context().Process(target=os.getpid)  # returns once the server has imported PRELOAD
    warm.start()
    warm.join()


def _child(rank: int, fn: Callable[..., Any], world_size: int, port: int, timeout_s: float,
           results: Any, kwargs: dict[str, Any], environ: dict[str, str]) -> None:
    import torch

    os.environ.clear()  # the parent's environment at the call, as a spawned rank would have it
    os.environ.update(environ)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        # Plain pickle copies tensor data; torch's queue reducers would share memory that
        # disappears with this process.
        results.put((rank, pickle.dumps(fn(rank, world_size, **kwargs))))
        # Tear down together: a rank destroying gloo while its peer still talks to it can
        # abort the peer ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise  # mp.spawn reports it to the parent with the traceback
    dist.destroy_process_group()
    # Skip C++ static destructors: a gloo thread alive then can abort a finished rank.
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run ``fn`` on ``world_size`` gloo ranks; return their results in rank order."""
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = _context()
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_child, args=(fn, world_size, store.port, timeout_s, results, kwargs,
                                             dict(os.environ)),
                               nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}

    def drain() -> None:
        # Read while children run: a result bigger than the pipe buffer blocks its sender.
        while not results.empty():
            rank, value = results.get()
            out[rank] = pickle.loads(value)

    def kill() -> list[int]:
        alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
        for p in procs.processes:
            if p.is_alive():
                p.kill()
        return alive

    try:
        while not procs.join(timeout=0.2):
            drain()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {kill()} still running after {timeout_s} s")
    except BaseException:
        # pytest-timeout's (or a ^C's) exception lands here too: a world left running would keep
        # the test session from exiting (the interpreter joins its children at exit)
        kill()
        raise
    drain()
    del store
    return [out[r] for r in range(world_size)]


def _cli_child(program: str, args: list[str], cwd: str, environ: dict[str, str], out_path: str,
               err_path: str) -> None:
    """The ``poise`` or ``torchrun`` command in a forked process, as ``python -m poise ARGS`` or
    ``python -m torch.distributed.run ARGS`` would run it."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [program, *args]
    from poise.cli import main
    from poise.launch.command import exit_code

    # a worker's failure under torchrun raises (ChildFailedError), as torchrun's own exit 1
    code = exit_code((lambda: main(args)) if program == "poise" else (lambda: _torchrun(args)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _torchrun(args: list[str]) -> None:
    """``torchrun ARGS``, as torch.distributed.run.main runs it; a script's workers are forked
    from this process (torchrun's own ``--run-path --start-method fork``, into
    :func:`_script_worker`), so that they hold the server's imports (torch, Lightning, Accelerate,
    transformers: 5-10 s of CPU per worker as a new interpreter). A module's (``-m``) or a
    program's workers start as torchrun starts them."""
    import torch.distributed.run as torchrun

    parsed = torchrun.parse_args(args)
    if not (parsed.module or parsed.no_python or parsed.run_path):
        parsed.run_path, parsed.start_method = True, "fork"
        torchrun.run_script_path = _script_worker  # the entry point config_from_args names for --run-path
        sys.stdout.flush()  # what a forked worker would otherwise write a second time
        sys.stderr.flush()
    torchrun.run(parsed)


def _script_worker(script: str, *argv: str) -> None:
    """A forked worker of ``torchrun SCRIPT ARGV``: what ``python SCRIPT ARGV`` gives a script
    (its argv, its folder first on sys.path, Python's signal handlers, the CPU threads that
    ``OMP_NUM_THREADS`` names, which torch read when this server imported it), then the script
    run as ``__main__``, then what it registered with ``atexit``. ``sys.exit(0)`` is a success,
    as it is for an interpreter."""
    import atexit
    import runpy

    import torch

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    atexit._clear()  # what this server registered to run at its own exit is not the script's
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        atexit._run_exitfuncs()  # the script's, as its interpreter runs them (an emulated slow rank's cgroup)
        sys.stdout.flush()
        sys.stderr.flush()


def run_cli(args: list[str], *, cwd: str | os.PathLike[str], env: dict[str, str] | None = None,
            timeout_s: float = 240.0, program: str = "poise") -> subprocess.CompletedProcess[str]:
    """Run ``poise ARGS`` (or ``torchrun ARGS`` with ``program="torchrun"``: a script's workers
    forked, see :func:`_torchrun`) in a process forked from the warm
    server (see the module doc): its exit code, stdout and stderr as text. On ``timeout_s``
    (seconds) the command and everything below it are killed and ``subprocess.TimeoutExpired``
    is raised, as ``subprocess.run`` does."""
    from poise.launch.processes import descendants, signal_all

    environ = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="poise-cli-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = _context().Process(target=_cli_child, args=(program, list(args), str(cwd), environ, out_path,
                                                           err_path))
        proc.start()
        timed_out = False
        try:
            proc.join(timeout_s)
        finally:
            if proc.is_alive():  # the deadline, or pytest-timeout's / a ^C's exception
                timed_out = True
                signal_all([proc.pid, *descendants(proc.pid)], signal.SIGKILL)
                proc.join(10)
        stdout, stderr = (Path(p).read_text(errors="replace") if os.path.exists(p) else ""
                          for p in (out_path, err_path))
    command = [program, *args]
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout_s, stdout, stderr)
    return subprocess.CompletedProcess(command, proc.exitcode, stdout, stderr)
