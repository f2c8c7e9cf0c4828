"""A job owns its output directory and ends in one line (issue 46, items 1, 7, 10): a second job
on the same ``--out`` is refused, an ``--out`` that cannot be written is one line, Ctrl-C and
SIGTERM stop every worker and release the directory, and a stopped rank is named as such."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poise import config as cfg
from poise.checkpoint import directory
from poise.cli.train import JOB_LOCK
from poise.launch.processes import end_tree, workers
from poise.runtime.launcher import WORKERS_LOCK
from tests.conftest import ROOT, run_poise

pytestmark = pytest.mark.e2e

JOB = ("train", "--task", "digits", "--nproc", "2", "--diagnostics.progress", "false", "--diagnostics.plot", "false",
       "--diagnostics.record_samples", "true")


def _start(out: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "poise", *JOB, "--out", str(out), *flags], stdout=handle,
                                stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, log


def _wait_for(predicate, proc: subprocess.Popen, what: str, limit: int = 900) -> None:
    for _ in range(limit):  # polls of 0.1 s; the test's timeout bounds it too
        if predicate() or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert predicate(), f"the job ended or stalled before {what}"


def _steps(out: Path) -> int:
    with contextlib.suppress(OSError):
        return (out / "samples" / "rank-00000.jsonl").read_text().count("\n")
    return 0


def _workers_of(out: Path) -> list[int]:
    """Processes still running this job's workers (whoever their parent now is, forked or not):
    those holding the output directory's workers' lock open."""
    lock = str(out / WORKERS_LOCK)
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            if os.readlink(fd) == lock:
                found.append(int(fd.parent.parent.name))
    return sorted(set(found))


@pytest.mark.timeout(200)
def test_a_second_job_on_the_same_out_is_refused_and_the_first_keeps_its_config(tmp_path):
    out = tmp_path / "out"
    first, log = _start(out, "--steps", "40", "--seed", "1")
    try:
        _wait_for(lambda: (out / "config.toml").exists(), first, "writing its config")
        before = (out / "config.toml").read_bytes()
        second = run_poise(*JOB, "--steps", "5", "--seed", "2", "--out", str(out), "--overwrite", timeout_s=60)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "output directory" in lines[0] and "in use by another job" in lines[0], lines
        assert f"pid {first.pid}" in lines[0]
        assert (out / "config.toml").read_bytes() == before
        assert first.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            end_tree(first)
    assert "40 steps" in log.read_text()


@pytest.mark.timeout(120)
def test_a_replaced_config_is_named_by_the_workers(tmp_path):
    """Defence in depth behind the lock: a config file that is not the one the command resolved
    (here: edited between the command and its workers) stops the workers in one line."""
    path = cfg.save(cfg.from_dict({"out_dir": str(tmp_path), "task": {"name": "digits"}}), tmp_path / "config.toml")
    env = {**os.environ, "POISE_CONFIG_HASH": "0" * 64}
    proc = subprocess.run([sys.executable, "-m", "poise.train.worker", "--config", str(path)],
                          capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "is not the config 'poise train' resolved for this job" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_an_out_that_is_a_file_is_one_line(tmp_path, where):
    file = tmp_path / "file"
    file.write_text("x")
    out = file if where == "file" else file / "sub"
    proc = run_poise(*JOB, "--steps", "5", "--out", str(out), timeout_s=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a directory" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_an_out_on_a_read_only_file_system_is_one_line(tmp_path):
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)],
                                           capture_output=True, timeout=30).returncode:
        pytest.skip("needs root and mount for a read-only file system")
    try:
        proc = run_poise(*JOB, "--steps", "5", "--out", str(mount / "run"), timeout_s=60)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Read-only file system" in lines[0], proc.stderr


@pytest.mark.timeout(200)
# workers forked from the command (this machine's default) and started as new interpreters
@pytest.mark.parametrize(("sig", "code", "start"), [(signal.SIGINT, 130, "fork"), (signal.SIGTERM, 143, "subprocess")],
                         ids=["SIGINT-fork", "SIGTERM-subprocess"])
def test_a_signal_stops_the_job_in_one_line_and_releases_everything(tmp_path, sig, code, start):
    out = tmp_path / "out"
    proc, log = _start(out, "--steps", "400", "--dist.start_method", start)
    try:
        _wait_for(lambda: _steps(out) >= 2, proc, "its second step")
        assert len(_workers_of(out)) == 2
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == code
    finally:
        if proc.poll() is None:
            end_tree(proc)
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert f"poise train: stopped by {sig.name}" in text.strip().splitlines()[-1]
    assert f"launching (workers by {start}: as set" in text
    assert not _workers_of(out)
    directory.lock(out, wait_s=0.0, name=JOB_LOCK)  # released: raises if anyone still held it
    directory.unlock(out, JOB_LOCK)


@pytest.mark.timeout(200)
def test_a_stopped_rank_is_named_as_stopped_soon(tmp_path):
    out = tmp_path / "out"
    proc, log = _start(out, "--steps", "400", "--dist.timeout_s", "60")
    try:
        _wait_for(lambda: _steps(out) >= 2, proc, "its second step")
        worker = next(pid for pid, rank in workers(proc.pid).items() if rank == 1)
        os.kill(worker, signal.SIGSTOP)
        assert proc.wait(timeout=150) == 1
    finally:
        if proc.poll() is None:
            end_tree(proc)
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("poise train: rank 1 stopped responding"), last


@pytest.mark.timeout(200)
def test_killing_the_command_outright_ends_its_workers_and_frees_the_directory(tmp_path):
    """Issue 57, item 10: a ``poise train`` killed by SIGKILL (the OOM killer) left its workers
    training on, beside the next job on the same ``--out``."""
    out = tmp_path / "out"
    proc, _ = _start(out, "--steps", "400")
    try:
        _wait_for(lambda: _steps(out) >= 2, proc, "its second step")
        assert len(_workers_of(out)) == 2
        proc.kill()
        proc.wait(timeout=60)
        for _ in range(300):  # polls of 0.1 s: the kernel ends them as their parent dies
            if not _workers_of(out):
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            end_tree(proc)
    assert not _workers_of(out), "workers outlived their command"
    assert not (out / "report.json").exists()
    from poise.cli.train import own_out_dir

    own_out_dir(out, cfg.DistConfig())  # free for the next job: raises if a worker still held it
    directory.unlock(out, JOB_LOCK)
