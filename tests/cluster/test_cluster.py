"""``poise cluster`` on real network namespaces: up/down, shaping, crashes, jobs across nodes.

These need root, ``ip`` and ``tc`` (CI has them) and are skipped, with the reason, elsewhere.
Every cluster gets a name of its own and is removed by the fixtures even when a test fails.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from poise.cli import main
from poise.cluster import net
from poise.cluster.state import ClusterState, node_namespace, owned_prefix
from tests.cluster.conftest import poise_namespaces
from tests.conftest import ROOT, run_poise

pytestmark = pytest.mark.cluster
QUIET = ("--diagnostics.progress", "false", "--diagnostics.plot", "false")


def _qdisc(ns: str, dev: str) -> str:
    return net.run("tc", "-n", ns, "qdisc", "show", "dev", dev).stdout


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.01)


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``poise ARGS`` in this process (no interpreter start-up): exit code, stdout, stderr."""
    capsys.readouterr()
    handlers = logging.getLogger("poise").handlers[:]
    try:
        code = main(list(args))
    finally:  # main() points poise's log handler at the captured stderr; put the old one back
        logging.getLogger("poise").handlers[:] = handlers
    out, err = capsys.readouterr()
    return code, out, err


def _default_sigint() -> None:
    # A suite started in the background (``cmd &``) inherits SIGINT ignored, and Python then
    # never raises KeyboardInterrupt: give the job the handler a terminal user's would have.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _popen_poise(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "poise", *args], cwd=ROOT, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_default_sigint)


@pytest.mark.timeout(90)
def test_up_is_idempotent_shapes_both_directions_and_down_twice_is_fine(cluster_name, capsys):
    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "2", "--name", cluster_name, "--link", "100mbit")
    assert code == 0, err
    state = ClusterState.load(cluster_name)
    assert state is not None and state.phase == "up"
    assert sorted(poise_namespaces(owned_prefix(cluster_name))) == sorted(state.namespaces)
    switch = state.namespaces[0]
    for node in range(2):
        ns = node_namespace(cluster_name, node)
        assert f"inet {state.address(node)}/24" in net.run("ip", "-n", ns, "addr", "show", "dev", "eth0").stdout
        assert "LOOPBACK,UP" in net.run("ip", "-n", ns, "link", "show", "lo").stdout
        for where, dev in ((ns, "eth0"), (switch, f"n{node}")):  # upload and download
            assert re.search(r"qdisc tbf 1: root .*rate 100Mbit", _qdisc(where, dev)), (where, dev)
        assert "master br0" in net.run("ip", "-n", switch, "link", "show", f"n{node}").stdout

    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "2", "--name", cluster_name, "--link", "100mbit")
    assert code == 0, err
    assert ClusterState.load(cluster_name) == state  # unchanged, same subnet
    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "3", "--name", cluster_name)
    assert code == 2 and "is already up with 2 node(s)" in err and len(err.strip().splitlines()) == 1

    code, out, _ = _cli(capsys, "cluster", "status")
    assert code == 0 and cluster_name in out and "100mbit" in out
    for _ in range(2):
        code, out, err = _cli(capsys, "cluster", "down", "--name", cluster_name)
        assert code == 0, err
        assert poise_namespaces(owned_prefix(cluster_name)) == []
        assert ClusterState.load(cluster_name) is None
    assert "nothing to remove" in out


@pytest.mark.timeout(90)
def test_check_measures_a_shaped_link(cluster_name, tmp_path, capsys):
    assert _cli(capsys, "cluster", "up", "--nodes", "2", "--name", cluster_name, "--link", "40mbit")[0] == 0
    out = tmp_path / "check.json"
    code, _, err = _cli(capsys, "cluster", "check", "--name", cluster_name, "--megabytes", "2", "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    assert [(t["src"], t["dst"]) for t in result["transfers"]] == [(0, 1), (1, 0)]
    for transfer in result["transfers"]:
        assert transfer["num_bytes"] == 2_000_000
        # Unshaped, these namespaces move Gbit/s; only a working 40 Mbit/s shaper keeps this under 1.2x.
        assert 0 < transfer["fraction_of_line_rate"] < 1.2


@pytest.mark.timeout(90)
def test_a_killed_up_leaves_nothing_the_next_up_or_down_cannot_clean(cluster_name, capsys):
    state_file = Path(os.environ["POISE_CLUSTER_STATE_DIR"]) / f"{cluster_name}.json"
    prefix = owned_prefix(cluster_name)
    for cleaner in ("up", "down"):
        proc = _popen_poise("cluster", "up", "--nodes", "12", "--name", cluster_name)
        try:
            _wait_for(lambda: len(poise_namespaces(prefix)) >= 3, 60, "the killed 'up' to create namespaces")
        finally:
            proc.kill()
            proc.wait()
        recorded = json.loads(state_file.read_text())
        assert recorded["phase"] == "creating"  # killed half way
        assert 3 <= len(poise_namespaces(prefix)) < 13
        if cleaner == "up":
            code, _, err = _cli(capsys, "cluster", "up", "--nodes", "2", "--name", cluster_name)
            assert code == 0, err
            assert sorted(poise_namespaces(prefix)) == sorted(f"{prefix}{s}" for s in ("sw", "n0", "n1"))
        code, _, err = _cli(capsys, "cluster", "down", "--name", cluster_name)
        assert code == 0, err
        assert poise_namespaces(prefix) == [] and not state_file.exists()


@pytest.mark.timeout(150)
def test_two_nodes_train_across_namespaces(cluster_name, tmp_path, capsys):
    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "2", "--procs-per-node", "1", "--name", cluster_name)
    assert code == 0, err
    out = tmp_path / "run"
    proc = run_poise("cluster", "run", "--name", cluster_name, "--", "poise", "train", "--task", "digits",
                     "--steps", "6", "--out", str(out), *QUIET, timeout_s=130)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval accuracy" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 6
    assert report["config"]["cluster"] == {"nodes": 2, "link": "1gbit", "delay": "", "name": cluster_name}
    state = ClusterState.load(cluster_name)
    for node in range(2):  # each agent ran in its own namespace, on its own address
        log = (out / "cluster" / f"node{node}.log").read_text()
        assert f"--node-rank={node}" in log and f"--local-addr={state.address(node)}" in log
        assert f"--rdzv-endpoint={state.address(0)}:" in log
        assert net.namespace_pids(node_namespace(cluster_name, node)) == []
    assert state.phase == "up"  # a named cluster stays up for the next job


@pytest.mark.timeout(150)
def test_a_failing_node_is_named_and_its_cluster_removed(cluster_support, state_dir, tmp_path):
    proc = run_poise("train", "--cluster", "2:1", "--link", "100mbit", "--task", "digits", "--steps", "30",
                     "--fail-at", "1:2", "--out", str(tmp_path), *QUIET,
                     timeout_s=130)
    assert proc.returncode == 1
    assert re.search(r"node 1 failed \(exit code 1\): rank 1 failed \(exit code -9\).*SIGKILL", proc.stderr), \
        proc.stderr[-3000:]
    name = re.search(r"on cluster (job\w+)", proc.stderr).group(1)
    assert poise_namespaces(owned_prefix(name)) == [] and list(state_dir.glob("*.json")) == []


def _start_endless_job(state_dir: Path, out: Path) -> tuple[subprocess.Popen[str], ClusterState]:
    """A ``poise train --cluster 2:1`` job, returned once both nodes run their agent and worker."""
    job = _popen_poise("train", "--cluster", "2:1", "--task", "digits", "--steps", "1000000", "--out", str(out),
                       *QUIET)

    def workers_running() -> bool:
        states = [ClusterState(**json.loads(p.read_text())) for p in state_dir.glob("job*.json")]
        return bool(states) and states[0].phase == "up" and all(
            len(net.namespace_pids(node_namespace(states[0].name, i))) >= 2 for i in range(2))

    try:
        _wait_for(workers_running, 120, "the job's agents and workers to start")
    except BaseException:
        job.kill()
        job.wait()
        raise
    (path,) = state_dir.glob("job*.json")
    return job, ClusterState(**json.loads(path.read_text()))


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_job_and_removes_its_cluster(cluster_support, state_dir, tmp_path):
    job, state = _start_endless_job(state_dir, tmp_path)
    pids = [p for ns in state.namespaces for p in net.namespace_pids(ns)]
    try:
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=100) == 130  # one shared grace period (15 s) plus teardown, on loaded cores
    finally:
        job.kill()
        job.wait()
    assert poise_namespaces(owned_prefix(state.name)) == [] and list(state_dir.glob("*.json")) == []
    assert not any(net.is_running(p) for p in pids)


@pytest.mark.timeout(150)
def test_a_killed_job_is_cleaned_by_the_next_up(cluster_name, state_dir, tmp_path, capsys):
    job, _ = _start_endless_job(state_dir, tmp_path)
    job.kill()  # SIGKILL: the front end cannot clean up
    job.wait()
    (stale_file,) = state_dir.glob("job*.json")
    stale = ClusterState(**json.loads(stale_file.read_text()))
    pids = [p for ns in stale.namespaces for p in net.namespace_pids(ns)]
    assert pids and stale.is_stale()
    code, out, _ = _cli(capsys, "cluster", "status")
    assert code == 0 and "stale" in out
    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "1", "--name", cluster_name)
    assert code == 0, err
    assert poise_namespaces(owned_prefix(stale.name)) == [] and not stale_file.exists()
    assert not any(net.is_running(p) for p in pids)


@pytest.mark.timeout(60)
def test_not_root_is_a_one_line_error(tmp_path):
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run the CLI as another user")
    proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                           "poise", "cluster", "up", "--nodes", "2", "--name", "never"],
                          capture_output=True, text=True, timeout=50, cwd=ROOT,
                          env={**os.environ, "POISE_CLUSTER_STATE_DIR": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "poise cluster: error: an emulated cluster needs root (network namespaces and tc): " \
                                  "run as root"


@pytest.mark.timeout(60)
def test_delay_needs_netem(cluster_name, capsys):
    code, _, err = _cli(capsys, "cluster", "up", "--nodes", "2", "--name", cluster_name, "--delay", "2ms")
    if net.netem_available():
        assert code == 0, err
        assert "netem" in _qdisc(node_namespace(cluster_name, 0), "eth0")
    else:
        assert code == 2 and "lacks" in err and "netem" in err and len(err.strip().splitlines()) == 1
        assert poise_namespaces(owned_prefix(cluster_name)) == []
