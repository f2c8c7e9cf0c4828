"""A ``poise`` command (``poise train ...``) in a process of its own, started without a new interpreter.

The benches run many real jobs one after another: each one as ``python -m poise train ...``
paid an interpreter start, torch's and poise's imports and, at its end, the interpreter's
teardown of them, about 5 s of CPU per job on a 2-core machine, before and after any training
(a 4-step code-lm job took 8 s of CPU in all). :func:`start` forks each command instead from a server
process that imported those modules once (Python's ``forkserver``, the way torch's own
``MultiProcessTestCase`` and our test harness start their ranks). The server never runs a torch
operation, so it holds no OpenMP pool and no GPU context that a fork could break; each command
is still a new process, in a session of its own, with the environment, working directory and
CPU affinity it is given, whose workers torch's elastic agent starts as it always does. Only the
imports are shared, so a job's own measurements (step times, stalls, losses) do not change.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# What the server imports once: the command line, the launcher and what a forked worker of
# ``poise train`` would import first (poise.train.worker and its FORK_PRELOAD). Named, as
# ``python -m poise`` names its module: this layer imports nothing above it.
PRELOAD = ("torch", "torch.distributed.run", "torch._dynamo", "poise.cli", "poise.cli.train",
           "poise.launch.elastic", "poise.train.worker")
_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _CONTEXT = ctx
    return _CONTEXT


def _run(args: list[str], cwd: str, environ: dict[str, str], log_path: str, append: bool,
         cpus: set[int] | None) -> None:
    """The forked command: ``python -m poise ARGS``, run by name as the interpreter would run
    it, with its output in ``log_path``."""
    os.setsid()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    opened = os.open(log_path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    for fd in (1, 2):
        os.dup2(opened, fd)
    os.close(opened)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # what is written is in the log if the job is killed
    sys.argv = ["poise", *args]
    atexit._clear()  # what the server registered to run at its own exit is not the command's
    # python -m poise, which exits with main's code
    code = exit_code(lambda: runpy.run_module("poise", run_name="__main__", alter_sys=True))
    atexit._run_exitfuncs()  # the command's own, as its interpreter would run them
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without the interpreter's teardown of torch's modules (about 1 s of CPU)


def exit_code(call: Callable[[], int | None]) -> int:
    """The code an interpreter would exit with after running ``call``: what it returns (None: 0),
    a ``SystemExit``'s code (a message: written to stderr, 1), or 1 after an exception, whose
    traceback is printed."""
    try:
        return call() or 0
    except SystemExit as exc:  # argparse's exit 2, or a command's sys.exit
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1


class PoiseProcess:
    """A started ``poise`` command, read as a :class:`subprocess.Popen` is: ``pid``,
    ``returncode`` (negative: the signal that ended it), :meth:`poll` and :meth:`wait`, so that
    :func:`poise.launch.processes.end_tree` ends it and everything below it."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout`` seconds (None: for ever); past it
        :class:`subprocess.TimeoutExpired`, as Popen raises."""
        self._process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(["poise"], timeout or 0.0)
        return code


def start(args: Sequence[str], log_path: Path, *, append: bool = False, cpus: set[int] | None = None,
          env: dict[str, str] | None = None, cwd: Path | None = None) -> PoiseProcess:
    """Start ``poise ARGS`` (see the module doc) with stdout and stderr in ``log_path`` (appended
    to with ``append``), on ``cpus`` (its CPU affinity, which everything it starts inherits;
    None: this process's), with ``env`` (None: this process's environment) in ``cwd``."""
    environ = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    process = _context().Process(target=_run, args=(list(args), str(cwd or Path.cwd()), environ, str(log_path),
                                                    append, cpus))
    process.start()
    return PoiseProcess(process)
