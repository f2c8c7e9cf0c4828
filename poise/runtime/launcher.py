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
``python -m MODULE`` (:func:`poise.runtime.dist.run_forked` is the entry point of a forked one).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import signal
import sys

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
# seconds between torch's agent's looks at its workers (torchrun's --monitor-interval, as poise's
# launcher sets it); a forked worker whose error is PEER_LOST fails two of them later
# (poise.runtime.dist.run_forked)
MONITOR_INTERVAL_S = 0.5


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

