"""A worker lives no longer than the launcher that started it, and is known by its name.

torch's elastic agent starts every new-interpreter worker in a session of its own, and a
forked one is its launcher's child like any other, so when the ``poise``
command that runs the agent is killed outright (SIGKILL, the OOM killer) no signal reaches
the workers: they would train on as orphans, writing checkpoints, samples and ``report.json``
into an output directory whose lock died with the command, beside whatever job takes it
next. Linux ends a process when its parent dies if it asks to (``prctl(PR_SET_PDEATHSIG)``):
:func:`die_with_launcher` asks for SIGKILL, and, since the launcher may already have died
before the request was made, checks that its parent is still the launcher whose pid
the launcher handed down (:data:`LAUNCHER_PID_ENV`). A worker started by anything else (a
plain ``torchrun``) has no such variable and is left alone.

Every worker names its process after its rank (:func:`become_worker`), so that the launcher's
watchdog and the fault injector find it whether it was forked or started as
``python -m MODULE``; :func:`run_forked` is the entry point of a forked one.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import signal
import sys
import time

# the pid of the process that starts the workers (torch's agent inside a ``poise`` command),
# set by :func:`poise.launch.elastic.launch` and inherited by the workers
LAUNCHER_PID_ENV = "POISE_LAUNCHER_PID"
# A lock file in the job's output directory that every worker a poise launcher started holds
# shared for as long as it lives: the lock of the directory itself (held by the ``poise``
# command) ends with the command, this one only with the last worker, so a new job on the
# directory (which takes it exclusively for a moment before it starts its own workers) is
# refused while any worker of an earlier one still runs.
WORKERS_LOCK = ".poise-workers.lock"
# A secret a one-machine launcher hands its workers (environment variables are readable by
# their own user only): the job's keys in rank 0's store live under it
# (:func:`poise.runtime.dist.job_store`), and the checkpoint writer's token is derived from it
# (:func:`job_token`) instead of read from the store, where any local process could replace it.
JOB_KEY_ENV = "POISE_JOB_KEY"
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# A worker's process name (``/proc/PID/comm``, what ``ps`` and ``top`` show; at most 15 bytes):
# how the launcher's watchdog and ``poise bench faults`` find the workers and their ranks, for
# workers forked from the launcher as for new interpreters (whose command lines differ).
WORKER_NAME = "poise rank {rank}"
# a rank's error that only reports that a peer went away: a consequence, not a cause
PEER_LOST = re.compile(r"connection (reset|closed) by peer|read error|broken pipe", re.IGNORECASE)
# seconds a forked worker whose error is PEER_LOST waits before it fails (:func:`run_forked`):
# twice the launcher's monitor interval (poise.launch.elastic)
CONSEQUENCE_DELAY_S = 1.0


def job_key() -> str:
    """This job's secret (:data:`JOB_KEY_ENV`), '' when the launcher gave none (multi-node, torchrun)."""
    key = os.environ.get(JOB_KEY_ENV, "")
    return key if key.isalnum() else ""


def job_token(purpose: str, attempt: int) -> str:
    """16 hex digits every rank of launcher attempt ``attempt`` derives alike from the job's
    secret for ``purpose``, with no exchange; '' without a secret."""
    key = job_key()
    if not key:
        return ""
    return hashlib.sha256(f"{key}/{purpose}/{attempt}".encode()).hexdigest()[:16]


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this process when its launcher dies, and end it now (exit 1,
    one line) if the launcher is already gone. A no-op outside a poise launcher or off Linux."""
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # cannot ask (a seccomp filter?): the launcher's lock check still refuses a second job
    if os.getppid() != int(expected):
        sys.stderr.write(f"poise worker: its launcher (pid {expected}) is gone: ending\n")
        os._exit(1)


def become_worker() -> None:
    """What every poise worker does first: take its name (:data:`WORKER_NAME`, from ``RANK``)
    and tie its life to its launcher's (:func:`die_with_launcher`)."""
    rank = os.environ.get("RANK", "")
    if rank.isdigit() and sys.platform.startswith("linux"):
        name = WORKER_NAME.format(rank=rank).encode()[:15]
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    die_with_launcher()


def worker_rank(name: str) -> int | None:
    """The global rank in a process name that :func:`become_worker` set, else None."""
    prefix = WORKER_NAME.split("{", 1)[0]
    rest = name.strip().removeprefix(prefix)
    return int(rest) if rest != name.strip() and rest.isdigit() else None


def run_forked(module: str, *argv: str) -> int:
    """The workers' entry point when the launcher forks them (``dist.start_method`` fork): what
    ``python -m module ARGV`` runs, in a process that already holds torch and ``module``.

    A forked worker starts with its launcher's state, and is given what a new interpreter would
    have: default handlers for the signals torch's agent catches (the agent's own would raise
    its SignalException here), and the CPU threads that ``OMP_NUM_THREADS`` names, which torch
    read when the launcher imported it. It ends by returning to torch's agent (which waits for
    the value), after what the worker registered to undo at exit
    (:func:`poise.runtime.dist.on_exit`); the process then ends without C++ static destructors,
    as :func:`poise.runtime.dist.exit_process` ends a worker started as a new interpreter.
    """
    import importlib

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    from poise.runtime import dist as rdist

    try:
        return importlib.import_module(module).main(list(argv))
    except Exception as exc:
        if PEER_LOST.search(str(exc)):
            # Only a consequence: torch's agent names the first forked worker it finds failed
            # (torch.multiprocessing's join), polling every half second. Leaving a second
            # later lets it find the rank that caused this one (killed, stopped or failed) first.
            time.sleep(CONSEQUENCE_DELAY_S)
        raise
    finally:
        rdist.run_exit_hooks()
        sys.stdout.flush()
        sys.stderr.flush()
