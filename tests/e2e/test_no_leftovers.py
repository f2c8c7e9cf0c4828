"""A job on one machine listens on loopback only, and leaves nothing behind: no cgroup of a
slowed rank, no worker of a bench job past its limit (issue 16, items 7 and 12)."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poise.bench.harness import run_train_job
from poise.emulate import speed as slowdown
from poise.launch.processes import cmdline, descendants
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

QUIET = ("--diagnostics.progress", "false", "--diagnostics.plot", "false")
_SS_LINE = re.compile(r"^LISTEN\s+\S+\s+\S+\s+(\S+):(\d+)\s+.*users:\((.*)\)")


def _listeners(pids: set[int]) -> list[str]:
    """Local addresses that processes in ``pids`` listen on (TCP), from ``ss -ltnpH``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    found = []
    for line in out.splitlines():
        match = _SS_LINE.match(line.strip())
        if match and {int(p) for p in re.findall(r"pid=(\d+)", match.group(3))} & pids:
            found.append(match.group(1).strip("[]"))
    return found


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False  # '*' or '0.0.0.0' style: every interface


def test_a_one_machine_job_listens_on_loopback_only(tmp_path):
    job = [sys.executable, "-m", "poise", "train", "--task", "digits", "--nproc", "2", "--steps", "60",
           "--rank-speed", "0:0.25", "--balance.slowdown_method", "sleep", "--checkpoint-every", "20",
           "--out", str(tmp_path), *QUIET]
    proc = subprocess.Popen(job, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            seen += _listeners({proc.pid, *descendants(proc.pid)})
            time.sleep(0.2)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert seen, "no listening socket of the job was seen"
    assert all(_is_loopback(a) for a in seen), sorted(set(seen))


@pytest.mark.skipif(slowdown._cpu_cgroup() is None, reason="no writable cgroup CPU controller")
def test_a_slowed_ranks_cgroup_is_removed_when_the_job_ends(tmp_path):
    root = slowdown._cpu_cgroup()[0]
    before = set(root.glob("poise-slow-*"))
    proc = subprocess.run([sys.executable, "-m", "poise", "train", "--task", "digits", "--nproc", "2", "--steps",
                           "4", "--rank-speed", "1:0.5", "--balance.slowdown_method", "cgroup", "--out",
                           str(tmp_path), *QUIET], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU quota" in proc.stderr
    left = {g for g in set(root.glob("poise-slow-*")) - before
            if not Path(f"/proc/{g.name.removeprefix('poise-slow-')}").exists()}
    assert not left, left


def test_a_bench_job_past_its_limit_ends_every_worker(tmp_path):
    with pytest.raises(RuntimeError, match="past its limit of 15 s"):
        run_train_job("long", tmp_path, ["--task", "digits", "--nproc", "2", "--steps", "100000"], 15.0)
    marker = str(tmp_path / "long")
    time.sleep(0.5)
    # every process of the job names its folder: in its command line (a worker started anew) or in
    # its open files (the command and whatever it forked write to the job's log)
    alive = [pid for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
             if pid != os.getpid() and (any(marker in arg for arg in cmdline(pid)) or _opened_under(pid, marker))]
    assert not alive, [cmdline(p) for p in alive]


def _opened_under(pid: int, folder: str) -> bool:
    """Whether process ``pid`` has a file under ``folder`` open."""
    try:
        return any(os.readlink(fd).startswith(folder) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone, or not ours to read
        return False
