"""A stopped worker is named as stopped, not as killed (issue 46, item 10), and the fault bench
kills only its own emulated nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from poise.bench.faults import job_namespaces
from poise.launch.elastic import failure_line
from poise.launch.watchdog import StoppedWorkerWatchdog, process_state


def _failure(rank: int, pid: int, exitcode: int, message: str, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="/nonexistent")
    if message:
        failure.message = message
    failure.timestamp = timestamp
    return failure


def test_the_watchdog_ends_a_worker_stopped_past_its_grace_and_names_its_rank():
    marker = "poise-watchdog-test-worker"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker],
                            env={**os.environ, "RANK": "1"})
    try:
        watchdog = StoppedWorkerWatchdog(marker, grace_s=5.0)
        assert watchdog.check(0.0) == []  # running: nothing to do
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):  # the stop takes effect asynchronously; polls of 0.05 s
            if process_state(proc.pid) == "T":
                break
            time.sleep(0.05)
        assert watchdog.check(100.0) == []  # first seen stopped at 100 s
        assert watchdog.check(104.0) == []  # within its grace
        ended = watchdog.check(105.0)
        assert [(w.rank, w.pid, w.stopped_s) for w in ended] == [(1, proc.pid, 5.0)]
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_rank_is_named_as_stopped_not_as_killed():
    from poise.launch.watchdog import StoppedWorker

    failures = {0: _failure(0, 100, -signal.SIGTERM, "", 10), 1: _failure(1, 101, -signal.SIGKILL, "", 10)}
    exc = ChildFailedError("poise.train.worker", failures)
    assert failure_line(exc).startswith("rank 1 failed (exit code -9)")  # what it said before
    line = failure_line(exc, [StoppedWorker(1, 101, 5.2)])
    assert line.startswith("rank 1 stopped responding: its process was stopped (SIGSTOP?) for 5 s")
    assert failure_line(exc, [StoppedWorker(1, 999, 5.2)]).startswith("rank 1 failed")  # another attempt's worker


def test_a_collective_timeout_before_the_kill_names_the_waiting_rank_and_the_collective():
    failures = {
        0: _failure(0, 100, 1, "RuntimeError: [gloo] Timed out waiting 120000ms for recv operation to complete", 130),
        1: _failure(1, 101, -signal.SIGKILL, "", 160),  # the agent's shutdown, 30 s later
    }
    line = failure_line(ChildFailedError("poise.train.worker", failures))
    assert line.startswith("rank 0 timed out after 120 s in a recv waiting for its peers: rank(s) [1] stopped "
                           "responding"), line
    killed_first = {0: _failure(0, 100, 1, "connection closed by peer", 11),
                    1: _failure(1, 101, -signal.SIGKILL, "", 10)}
    assert failure_line(ChildFailedError("w", killed_first)).startswith("rank 1 failed (exit code -9)")


@pytest.mark.parametrize(("names", "want"), [
    (["poise-job123_ab12-n1", "poise-job123_ab12-n0", "poise-job1234_ab12-n1", "poise-job12_ab12-n1",
      "poise-mycluster-n1", "poise-job123_ab12-sw"], ["poise-job123_ab12-n1"]),
    (["poise-job123_x-y-n1"], []),
])
def test_the_node_fault_kills_only_the_namespaces_of_the_bench_s_own_job(names, want):
    assert job_namespaces(123, 1, names) == want
