"""Process trees: finding every process a job started, and ending them all.

torch's elastic launcher starts each new-interpreter worker in a session of its own, so
neither a process group nor a session reaches them from the job's front end: a job is its
front end's descendants, read from /proc. Used to end a bench job past its time limit and to inject
faults into a job's workers (``poise bench faults``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Protocol

from poise.runtime.launcher import worker_rank


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before children (read from /proc; Linux only)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` ([] when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def workers(pid: int) -> dict[int, int]:
    """The poise workers below ``pid``: their pids and global ranks, by the name each worker
    gives its process (:func:`poise.runtime.launcher.become_worker`), forked or not."""
    found = {}
    for child in descendants(pid):
        try:
            name = Path(f"/proc/{child}/comm").read_text()
        except OSError:
            continue  # gone
        rank = worker_rank(name)
        if rank is not None:
            found[child] = rank
    return found


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Started(Protocol):
    """A started process as :class:`subprocess.Popen` reads it (or a forked ``poise`` command:
    :class:`poise.launch.command.PoiseProcess`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def end_tree(proc: Started, grace_s: float = 10.0) -> None:
    """End ``proc`` and everything below it: SIGTERM to the front end (torch's agent then stops its
    workers in order), and after ``grace_s`` seconds SIGKILL to whatever of the tree is left;
    stopped processes are continued so that they can die. Waits for ``proc``."""
    tree = descendants(proc.pid)
    signal_all([proc.pid], signal.SIGTERM)
    signal_all(tree, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    tree = sorted(set(tree) | set(descendants(proc.pid)))
    signal_all([proc.pid, *tree], signal.SIGKILL)
    signal_all(tree, signal.SIGCONT)
    proc.wait()
