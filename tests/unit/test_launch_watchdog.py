"""A stopped worker is named as stopped, not as killed (issue 46, item 10), the fault bench
kills only its own emulated nodes, and workers are forked only where that is safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from poise.bench.faults import job_namespaces
from poise.config import DistConfig
from poise.launch.elastic import failure_line, fork_risk, start_method
from poise.launch.watchdog import StoppedWorkerWatchdog, process_state


def _failure(rank: int, pid: int, exitcode: int, message: str, timestamp: int) -> ProcessFailure:
    failure = ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file="/nonexistent")
    if message:
        failure.message = message
    failure.timestamp = timestamp
    return failure


def test_the_watchdog_ends_a_worker_stopped_past_its_grace_and_names_its_rank():
    # a worker by its name (what every poise worker calls first), whatever its command line
    code = "import time; from poise.runtime.launcher import become_worker; become_worker(); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": "1"})
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={**os.environ, "RANK": "0"})
    try:
        watchdog = StoppedWorkerWatchdog(grace_s=5.0)
        for _ in range(200):  # until it has named itself; polls of 0.05 s
            if Path(f"/proc/{proc.pid}/comm").read_text().strip() == "poise rank 1":
                break
            time.sleep(0.05)
        assert watchdog.check(0.0) == []  # running: nothing to do
        os.kill(bystander.pid, signal.SIGSTOP)  # not a worker: left alone
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
        assert process_state(bystander.pid) == "T"
    finally:
        for p in (proc, bystander):
            p.kill()  # SIGKILL ends a stopped process too
            p.wait()


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


@pytest.mark.parametrize(("setting", "gpu_build", "cores", "nproc", "threads", "want", "risky"), [
    ("auto", False, 2, 2, 0, "fork", False),  # this machine: one thread per worker
    ("auto", False, 16, 2, 0, "subprocess", True),  # 8 threads each: OpenMP's pool does not survive a fork
    ("auto", False, 16, 2, 1, "fork", False),  # pinned to one thread each
    ("auto", True, 2, 2, 0, "subprocess", True),  # a CUDA build: its runtime does not survive a fork
    ("fork", True, 16, 2, 0, "fork", True),  # as set: the launcher warns that it is unsafe here
    ("subprocess", False, 2, 2, 0, "subprocess", False),
])
def test_workers_are_forked_only_where_it_is_safe_or_set(setting, gpu_build, cores, nproc, threads, want, risky):
    dist = DistConfig(start_method=setting, nproc=nproc, threads_per_worker=threads)
    risk = fork_risk(dist, gpu_build=gpu_build, cores=cores)
    how, why = start_method(dist.start_method, risk)
    assert how == want and why and bool(risk) == risky
