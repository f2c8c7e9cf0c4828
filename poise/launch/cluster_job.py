"""Run one ``poise train`` job across the nodes of an emulated cluster.

Each node gets its own torch elastic agent inside its namespace (:mod:`poise.launch.agent`),
with ``--nnodes N --node-rank i``, the c10d rendezvous on node 0's address, ``--local-addr``
set to the node's own address and ``is_host`` set explicitly (inside a namespace the hostname
resolves to 127.0.0.1, so torch can neither guess who hosts the store nor which address to
advertise), and gloo bound to the node's interface. All traffic therefore goes to addresses
inside the cluster's namespaces. The job's ``out_dir`` is on the shared file system; rank 0
writes ``report.json`` there as usual, and each agent's output goes to ``cluster/node<i>.log``.

When an agent fails, the others get a grace period to fail on their own (their peers are
gone) and are then stopped; whatever still runs inside the nodes afterwards is stopped too, and
a cluster brought up for the job is always taken down again, on Ctrl-C and SIGTERM as well.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from poise.cluster import net, topology
from poise.cluster.state import NODE_IFNAME, ClusterState, node_namespace, open_private
from poise.config import DistConfig, RunConfig
from poise.launch.elastic import PEER_LOST
from poise.runtime.dist import threads_for

log = logging.getLogger(__name__)

RDZV_PORT = 29400
# After the first agent fails, the others have this long to notice and leave on their own.
_FAILURE_GRACE_S = 15.0
_STOP_GRACE_S = 10.0
_RANK_FAILED = re.compile(r"rank \d+ failed .*")
# torch's log lines, C++ ("[W1201 14:46:28.843 socket.cpp:207] [c10d] ...") and Python
# ("W1201 15:54:01.998000 22909 .../run.py:865] ..."): the library's warnings, never the reason
# a node failed, so they are not taken as its last line
_TORCH_LOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d")


def cluster_defaults(name: str) -> dict[str, Any]:
    """The settings a job on existing cluster ``name`` takes from it (nested, config layout).

    Raises:
        ValueError: when no such cluster is up.
    """
    state = _existing(name)
    return {
        "cluster": {"name": name, "nodes": state.nodes, "link": state.link,
                    "delay": f"{state.delay_s * 1e6:g}us" if state.delay_s else ""},
        "dist": {"nproc": state.procs_per_node},
    }


def check_job(config: RunConfig) -> None:
    """Everything a cluster job needs, checked before anything is written or started.

    Raises:
        ValueError: not root, ``ip``/``tc`` or kernel support missing, the named cluster not
            up, or its shape not the job's; one line each.
    """
    spec = config.cluster
    if not spec.name:
        net.require_support(delay=spec.delay_s > 0)
        return
    state = _existing(spec.name)
    wanted = (spec.nodes, spec.link_rate_bit_per_s, spec.delay_s)
    if wanted != (state.nodes, state.link_rate_bit_per_s, state.delay_s):
        raise ValueError(
            f"cluster {spec.name!r} has {state.nodes} node(s) at {state.link}, but the job asks for "
            f"cluster.nodes={spec.nodes}, cluster.link={spec.link!r}, cluster.delay={spec.delay!r}"
        )


def run_on_cluster(config: RunConfig, config_path: Path | None, *, module: str, command: str,
                   module_args: Sequence[str] | None = None) -> int:
    """Run the job of ``config`` (saved at ``config_path``) on its emulated cluster: the workers
    of ``module``, for ``poise COMMAND``.

    With ``cluster.name`` the named cluster is used as it is; otherwise one of
    ``cluster.nodes`` nodes is brought up for this job and taken down after it. ``module_args``
    replace ``--config config_path`` on the workers' command line (``poise diagnose``).

    Returns:
        0, or 1 when an agent failed (a line naming the node and rank goes to stderr).
    """
    check_job(config)
    spec = config.cluster
    try:
        if spec.name:
            with _terminate_as_interrupt():
                return _run_agents(_existing(spec.name), config, config_path, module, command, module_args)
        name = f"job{os.getpid()}_{secrets.token_hex(2)}"
        with _terminate_as_interrupt():
            try:
                state = topology.up(name, spec.nodes, config.dist.nproc, spec.link_rate_bit_per_s, spec.delay_s,
                                    owned_by_this_process=True)
                return _run_agents(state, config, config_path, module, command, module_args)
            finally:
                topology.down(name)
    except KeyboardInterrupt as exc:  # the agents are stopped and the cluster is down by now
        sig = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        sys.stderr.write(f"poise {command}: stopped by {sig.name}{' (Ctrl-C)' if sig == signal.SIGINT else ''}; "
                         "the workers are stopped\n")
        return 128 + int(sig)


def node_dist(state: ClusterState, base: DistConfig, node: int, rdzv_id: str) -> DistConfig:
    """Node ``node``'s launcher settings: the job's, placed on the cluster's addresses."""
    return dataclasses.replace(
        base, nnodes=str(state.nodes), node_rank=node, rdzv_backend="c10d", rdzv_id=rdzv_id,
        rdzv_endpoint=f"{state.address(0)}:{RDZV_PORT}", local_addr=state.address(node),
        rdzv_is_host=node == 0, socket_ifname=NODE_IFNAME,
    )


def _existing(name: str) -> ClusterState:
    net.require_root()
    state = ClusterState.load(name)
    if state is None or state.phase != "up":
        raise ValueError(f"cluster {name!r} is not up: start it with 'poise cluster up --name {name} --nodes N'")
    return state


def _run_agents(state: ClusterState, config: RunConfig, config_path: Path | None, module: str, command: str,
                module_args: Sequence[str] | None) -> int:
    namespaces = [node_namespace(state.name, i) for i in range(state.nodes)]
    busy = [ns for ns in namespaces if net.namespace_pids(ns)]
    if busy:
        raise ValueError(f"cluster {state.name!r} is busy: processes are running in {', '.join(busy)}")
    logs = Path(config.out_dir) / "cluster"
    logs.mkdir(parents=True, exist_ok=True)
    rdzv_id = f"{state.name}-{secrets.token_hex(4)}"
    threads = threads_for(config, config.dist.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log.info("job %s on cluster %s: %d node(s) x %d worker(s), %s links, logs in %s",
             rdzv_id, state.name, state.nodes, config.dist.nproc, state.link, logs)
    agents: list[_Agent] = []
    try:
        for node, ns in enumerate(namespaces):
            dist = node_dist(state, config.dist, node, rdzv_id)
            argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "poise.launch.agent",
                    "--dist", json.dumps(dataclasses.asdict(dist)), "--module", module, "--command", command]
            if config_path is not None:
                argv += ["--config", str(config_path)]
            if module_args is not None:
                argv += ["--module-args", json.dumps(list(module_args))]
            agents.append(_Agent(node, argv, env, logs / f"node{node}.log", echo=node == 0))
        code, message = _wait(agents)
    finally:
        _stop(agents)
        leftovers = [pid for ns in namespaces for pid in net.namespace_pids(ns)]
        if leftovers:
            log.info("stopping %d process(es) the job left in cluster %s", len(leftovers), state.name)
            net.stop_processes(leftovers)
        for agent in agents:
            agent.close()
    # after the other agents are stopped and their output copied: their own one-line "stopped by
    # SIGTERM" is a consequence, and the cause is the line a user reads last
    if message:
        sys.stderr.write(f"poise {command}: {message}\n")
    return code


def _stop(agents: list[_Agent]) -> None:
    """SIGTERM every running agent at once (torch's agent then stops its workers), SIGKILL those
    still running after a grace period shared by all: stopping a job takes one grace period,
    not one per node."""
    for sig, wait_s in ((signal.SIGTERM, _STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        running = [a for a in agents if a.proc.poll() is None]
        for agent in running:
            agent.signal(sig)
        deadline = time.monotonic() + wait_s
        for agent in running:
            try:
                agent.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _wait(agents: list[_Agent]) -> tuple[int, str]:
    """Wait for every agent; returns 0, or 1 and what names the node whose failure caused the others."""
    failed: list[_Agent] = []  # in the order their failures were seen
    first_failed_at = 0.0
    while True:
        newly = [a for a in agents if a.proc.poll() not in (None, 0) and a not in failed]
        if newly and not failed:
            first_failed_at = time.monotonic()
        failed += newly
        running = [a for a in agents if a.proc.returncode is None]
        if not running:
            break
        if failed and time.monotonic() - first_failed_at > _FAILURE_GRACE_S:
            log.warning("stopping node(s) %s after node %d failed", [a.node for a in running], failed[0].node)
            break
        time.sleep(0.2)
    if not failed:
        return 0, ""
    for agent in failed:
        agent.reader.join(timeout=5.0)
    # A killed worker is reported late (its agent notices it at the next monitor tick), while its
    # peers fail at once with "connection reset/closed by peer": those are consequences.
    cause = next((a for a in failed if not PEER_LOST.search(a.failure_line())), failed[0])
    code = cause.proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else \
        f"exit code {code}"
    # a node killed by a signal said nothing about it: its last line is whatever it was doing
    line = cause.failure_line() if code >= 0 or cause.rank_failed else ""
    return 1, f"node {cause.node} failed ({how}){': ' + line if line else ''} (log: {cause.log_path})"


class _Agent:
    """One node's agent process, its output copied line by line to its log (and to stderr for node 0)."""

    def __init__(self, node: int, argv: list[str], env: dict[str, str], log_path: Path, echo: bool) -> None:
        self.node, self.log_path, self._echo = node, log_path, echo
        # opened as root: never through a symlink someone planted at the log's path
        self._log: IO[str] = os.fdopen(open_private(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
        self._last_line = ""
        self._rank_line = ""
        # A session of its own: Ctrl-C reaches the front end only, which stops agents in order.
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._copy_output, name=f"node{node}-output", daemon=True)
        self.reader.start()

    def _copy_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.strip() and not _TORCH_LOG.match(line):
                self._last_line = line.strip()
            match = _RANK_FAILED.search(line)
            if match and not self._rank_line:
                self._rank_line = match.group(0)
            if self._echo:
                sys.stderr.write(line)

    @property
    def rank_failed(self) -> bool:
        """Whether the agent reported one of its workers' failure."""
        return bool(self._rank_line)

    def failure_line(self) -> str:
        """The agent's own line naming the failed rank, else its last line of output ('' for none)."""
        return self._rank_line or self._last_line

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the agent's session (the agent and the workers it started)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.reader.join(timeout=5.0)
        self._log.close()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that the same cleanup runs (exit code 143, not 130)."""


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt meanwhile, so a terminated job still cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
