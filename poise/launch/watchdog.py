"""Noticing a worker that stopped responding, sooner than its peers' collectives time out.

A worker whose process is stopped (``SIGSTOP``, a job-control stop: state ``T`` in
``/proc/<pid>/stat``) neither fails nor exits, so torch's elastic agent, which watches its
workers only for exits (``monitor_interval``), sees nothing; its peers block in their next
collective until ``dist.timeout_s`` (120 s by default) and the agent then needs its shutdown
timeout (30 s) before SIGKILL ends the stopped one, which is then reported as killed by
SIGKILL: the symptom, after 150 s, not the cause. torchelastic has no health check of its own
beyond exits; torchft's manager learns of a stuck replica from missed heartbeats to its
lighthouse. Here the launcher is on the same machine as its workers, so a look at their
process state is enough: :class:`StoppedWorkerWatchdog` polls it every ``period_s`` and ends a
worker stopped for ``grace_s`` seconds (SIGKILL, then SIGCONT so that it can die), recording
which rank and for how long, so the launcher can restart the job at once and name the cause.

A worker that hangs while running (a deadlock in user code) is not stopped; its peers'
collective timeout still ends the job, and the launcher names the rank that timed out
(:func:`poise.launch.elastic.root_failure`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from poise.launch.processes import signal_all, workers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoppedWorker:
    """A worker the watchdog ended: its global rank, pid, and seconds stopped."""

    rank: int
    pid: int
    stopped_s: float


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (``R``, ``S``, ``T``...; '' when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class StoppedWorkerWatchdog:
    """Ends this process's workers (:func:`~poise.launch.processes.workers`) that stay stopped
    for ``grace_s`` seconds (see the module doc); ``ended`` lists them, oldest first. Use as a
    context manager."""

    def __init__(self, grace_s: float, period_s: float = 0.5) -> None:
        self.grace_s, self.period_s = grace_s, period_s
        self.ended: list[StoppedWorker] = []
        self._since: dict[int, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poise-watchdog", daemon=True)

    def __enter__(self) -> StoppedWorkerWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            try:
                self.check(time.monotonic())
            except Exception as exc:  # a watchdog must never take the launcher down
                log.debug("watchdog: %s", exc)

    def check(self, now: float) -> list[StoppedWorker]:
        """One look at the workers at time ``now`` (seconds, monotonic); returns those ended."""
        ranks = workers(os.getpid())
        stopped = {pid for pid in ranks if process_state(pid) == "T"}
        self._since = {pid: self._since.get(pid, now) for pid in stopped}
        ended = []
        for pid, since in list(self._since.items()):
            if now - since < self.grace_s:
                continue
            worker = StoppedWorker(ranks[pid], pid, now - since)
            log.warning("rank %d (pid %d) stopped responding: its process has been stopped for %.0f s "
                        "(SIGSTOP?); ending it so that the job can stop or restart", worker.rank, pid,
                        worker.stopped_s)
            signal_all([pid], signal.SIGKILL)
            signal_all([pid], signal.SIGCONT)
            del self._since[pid]
            ended.append(worker)
        self.ended += ended
        return ended
