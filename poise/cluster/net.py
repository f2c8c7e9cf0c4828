"""The system calls of an emulated cluster: ``ip`` and ``tc``, and what they need.

Every command runs with a timeout and a failure is a :class:`NetError` naming the command and
``ip``'s own one-line message. :func:`require_support` checks once per process, before
anything is created, that we are root, that ``ip`` and ``tc`` exist, and that the kernel has
what a cluster is built from (network namespaces, veth pairs, a bridge and the tbf qdisc): it
builds them in a throw-away namespace, so a missing piece is reported up front and never half
way through ``up``.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import time

log = logging.getLogger(__name__)

NS_PREFIX = "poise-"
_COMMAND_TIMEOUT_S = 30.0
# The probe's namespace cannot clash with a cluster's: cluster names never start with '-'.
_PROBE_NS = NS_PREFIX + "-probe-{pid}"


class NetError(ValueError):
    """A cluster cannot be built or used here (one line, for the CLI's exit code 2)."""


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command (bounded); raises NetError with its message on failure."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetError(f"'{' '.join(argv)}' did not finish in {_COMMAND_TIMEOUT_S:.0f} s") from None
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetError(f"'{' '.join(argv)}' failed: {message[-1] if message else f'exit code {proc.returncode}'}")
    return proc


def list_namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``)."""
    out = run("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Processes running inside namespace ``ns`` (empty when it does not exist)."""
    proc = run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def stop_processes(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM ``pids``, then SIGKILL whichever are still alive after ``grace_s`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 2.0)
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if is_running(p)]
            time.sleep(0.05)
        if not alive:
            return
        pids = alive


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when there is no such process.

    A pid plus its start time names one process for good, even after the pid is reused.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def delete_namespace(ns: str) -> bool:
    """Stop every process inside ``ns`` and delete it (its links and qdiscs go with it).

    Returns:
        True when the namespace existed.
    """
    if ns not in list_namespaces():
        return False
    pids = namespace_pids(ns)
    if pids:
        log.info("stopping %d process(es) still running in %s", len(pids), ns)
        stop_processes(pids)
    run("ip", "netns", "delete", ns)
    return True


def require_root() -> None:
    """Raises NetError unless this process is root (namespaces and tc need CAP_NET_ADMIN)."""
    if os.geteuid() != 0:
        raise NetError("an emulated cluster needs root (network namespaces and tc): run as root")


def require_tools() -> None:
    """Raises NetError naming ``ip`` or ``tc`` when either is not installed."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetError(f"{' and '.join(missing)} not found: install iproute2 (an emulated cluster calls ip and tc)")


@functools.cache
def _kernel_probe() -> str:
    """'' when the kernel can build a cluster, else the first missing piece (one line)."""
    ns = _PROBE_NS.format(pid=os.getpid())
    steps = [
        ("network namespaces", ["ip", "netns", "add", ns]),
        ("veth pairs", ["ip", "-n", ns, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]),
        ("bridges", ["ip", "-n", ns, "link", "add", "b0", "type", "bridge"]),
        ("the tbf qdisc", ["tc", "-n", ns, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1gbit",
                           "burst", "65536", "limit", "131072"]),
    ]
    try:
        for what, argv in steps:
            try:
                run(*argv)
            except NetError as exc:
                return f"this kernel lacks {what}, which an emulated cluster needs ({exc})"
        return ""
    finally:
        if ns in list_namespaces():
            run("ip", "netns", "delete", ns, check=False)


@functools.cache
def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (link delay); probed once in a throw-away namespace."""
    ns = _PROBE_NS.format(pid=os.getpid())
    try:
        run("ip", "netns", "add", ns)
        return run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        run("ip", "netns", "delete", ns, check=False)


def require_support(delay: bool = False) -> None:
    """Everything an emulated cluster needs, checked once per process (see the module docstring).

    Raises:
        NetError: one line naming what is missing.
    """
    require_root()
    require_tools()
    missing = _kernel_probe()
    if missing:
        raise NetError(missing)
    if delay and not netem_available():
        raise NetError(
            "link delay needs the netem qdisc, which this kernel lacks (sch_netem is neither built in nor loaded): "
            "run without a link delay"
        )
