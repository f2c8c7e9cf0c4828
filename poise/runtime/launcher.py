"""A worker lives no longer than the launcher that started it.

torch's elastic agent starts every worker in a session of its own, so when the ``poise``
command that runs the agent is killed outright (SIGKILL, the OOM killer) no signal reaches
the workers: they would train on as orphans, writing checkpoints, samples and ``report.json``
into an output directory whose lock died with the command, beside whatever job takes it
next. Linux ends a process when its parent dies if it asks to (``prctl(PR_SET_PDEATHSIG)``):
:func:`die_with_launcher` asks for SIGKILL, and, since the launcher may already have died
before the request was made, checks that its parent is still the launcher whose pid
the launcher handed down (:data:`LAUNCHER_PID_ENV`). A worker started by anything else (a
plain ``torchrun``) has no such variable and is left alone.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
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
