"""Workers die with their launcher, and a new job waits for an earlier one's last worker (issue 57,
item 10): a ``poise train`` killed outright (SIGKILL, the OOM killer) left its workers training
on, beside the next job on the same ``--out``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poise import config as cfg
from poise.checkpoint import directory
from poise.cli import train
from poise.cli.train import JOB_LOCK, own_out_dir
from poise.runtime.launcher import LAUNCHER_PID_ENV, WORKERS_LOCK
from tests.conftest import ROOT

# A "launcher" that starts one "worker" (which asks to die with it, then sleeps) and prints its pid.
_LAUNCHER = """
import os, subprocess, sys, time
os.environ[{env!r}] = str(os.getpid())
child = subprocess.Popen([sys.executable, "-c",
    "from poise.runtime.launcher import die_with_launcher; die_with_launcher(); print('armed', flush=True); "
    "import time; time.sleep(120)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.timeout(60)
def test_a_worker_in_its_own_session_dies_when_its_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER.format(env=LAUNCHER_PID_ENV)],
                                stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        worker = int(launcher.stdout.readline())
        assert _alive(worker)
        launcher.kill()
        launcher.wait(timeout=30)
        for _ in range(300):  # polls of 0.1 s: the kernel's SIGKILL comes at once
            if not _alive(worker):
                break
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its launcher"
    finally:
        launcher.kill()


def test_a_worker_whose_launcher_is_already_gone_ends_at_once():
    env = {**os.environ, LAUNCHER_PID_ENV: "1"}  # not this child's parent: as if reparented
    proc = subprocess.run([sys.executable, "-c", "from poise.runtime.launcher import die_with_launcher; "
                           "die_with_launcher(); print('trained')"], capture_output=True, text=True, env=env,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 1 and "trained" not in proc.stdout
    assert proc.stderr.strip() == "poise worker: its launcher (pid 1) is gone: ending"


@pytest.mark.timeout(60)
def test_a_new_job_is_refused_while_a_worker_of_an_earlier_one_holds_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "ORPHANS_WAIT_S", 0.0)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import os
os.environ[{LAUNCHER_PID_ENV!r}] = "1"
from pathlib import Path
from poise.train.entry import hold_out_dir
hold_out_dir(Path({str(out)!r}))
print("held", flush=True)
import time; time.sleep(120)
"""], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="workers of an earlier job still run there") as err:
            own_out_dir(out, cfg.DistConfig())
        assert "\n" not in str(err.value) and f"pid {holder.pid}" in str(err.value)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    own_out_dir(out, cfg.DistConfig())  # the worker is gone: the directory is free
    directory.unlock(out, JOB_LOCK)
    assert not (out / WORKERS_LOCK).is_symlink()


def test_a_one_machine_jobs_store_keys_live_under_its_secret(monkeypatch):
    """Issue 57, item 11: any local process could write the job's keys in rank 0's store (it
    replaced checkpoint/token); under a poise launcher they are under a secret the workers
    inherit, which no other user can read."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from poise.runtime.dist import job_store
    from poise.runtime.launcher import JOB_KEY_ENV

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(JOB_KEY_ENV, "5ec7e7" * 4)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = job_store(0, cfg.DistConfig())
    store.set("checkpoint/token", "mine")
    other = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert not dist.PrefixStore("poise/attempt-0/", other).check(["checkpoint/token"])  # its name before
    assert dist.PrefixStore(f"poise/{'5ec7e7' * 4}/attempt-0/", other).get("checkpoint/token") == b"mine"
