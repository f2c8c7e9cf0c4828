"""What a cluster is made of, recorded on disk before it is built.

One JSON file per cluster (``<state dir>/<name>.json``, written atomically) lists the cluster's
shape, its subnet and every namespace it owns. ``up`` writes it, with ``phase = "creating"``,
before it creates the first object, and marks it ``"up"`` at the end; ``down`` deletes what the
file names and then the file. So a crash or a ``kill -9`` at any point leaves a file that
names everything that may exist, and the next ``up`` or ``down`` removes it. Every object
(links, the bridge, qdiscs) lives inside the cluster's namespaces, so deleting the namespaces
removes them all; nothing is added to the host's own namespace.

The state directory is ``/run/poise/clusters`` (gone after a reboot, like the namespaces
themselves), or ``$POISE_CLUSTER_STATE_DIR``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from poise.cluster.net import NS_PREFIX, process_start_ticks
from poise.config import MAX_NODES, validate_name
from poise.files import write_json_atomic
from poise.units import format_rate_bit_per_s

DEFAULT_STATE_DIR = "/run/poise/clusters"
MAX_PROCS_PER_NODE = 64
# Every node's workers run on this one machine: more than this in all is almost certainly a typo.
MAX_PROCESSES = 64
# Inside every node namespace the link has the same name, so one GLOO_SOCKET_IFNAME fits all.
NODE_IFNAME = "eth0"
BRIDGE = "br0"
PHASES = ("creating", "up")


def state_dir() -> Path:
    """Where cluster state files live (``$POISE_CLUSTER_STATE_DIR`` or /run/poise/clusters).

    Raises:
        ValueError: it exists but is not a directory owned by this user that only this user can
            write: whoever can write there decides which namespaces ``down`` deletes (as root).
    """
    directory = Path(os.environ.get("POISE_CLUSTER_STATE_DIR") or DEFAULT_STATE_DIR)
    try:
        info = directory.lstat()
    except FileNotFoundError:
        return directory
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"cluster state directory {directory} is not a directory (a symlink or a file): remove it")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise ValueError(f"cluster state directory {directory} is writable by others or not owned by uid "
                         f"{os.geteuid()} (mode {stat.S_IMODE(info.st_mode):o}, owner {info.st_uid}): "
                         "chmod go-w / chown it, or remove it")
    return directory


def open_private(path: Path, flags: int) -> int:
    """``os.open`` that never follows a symlink at ``path`` (files opened as root), mode 0644."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


def validate_shape(nodes: int, procs_per_node: int) -> None:
    """Raises ValueError unless 1 <= nodes <= 64, 1 <= procs_per_node <= 64 and they make at
    most 64 processes in all (integers)."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes={nodes!r} is invalid: allowed is 1..{MAX_NODES}")
    if not isinstance(procs_per_node, int) or isinstance(procs_per_node, bool) \
            or not 1 <= procs_per_node <= MAX_PROCS_PER_NODE:
        raise ValueError(f"procs_per_node={procs_per_node!r} is invalid: allowed is 1..{MAX_PROCS_PER_NODE}")
    if nodes * procs_per_node > MAX_PROCESSES:
        raise ValueError(f"{nodes} node(s) x {procs_per_node} worker(s) is {nodes * procs_per_node} processes on "
                         f"this machine: allowed is at most {MAX_PROCESSES} in all")


def switch_namespace(name: str) -> str:
    """The namespace holding the cluster's bridge."""
    return f"{NS_PREFIX}{name}-sw"


def node_namespace(name: str, node: int) -> str:
    """The namespace of node ``node`` (0-based)."""
    return f"{NS_PREFIX}{name}-n{node}"


def owned_prefix(name: str) -> str:
    """Every namespace of cluster ``name`` starts with this (and no other cluster's does)."""
    return f"{NS_PREFIX}{name}-"


@dataclass
class ClusterState:
    """One cluster: its shape, link, addresses, the namespaces it owns and who owns it.

    ``link_rate_bit_per_s`` shapes each node's link in both directions; ``delay_s`` is the
    one-way delay added to each direction (0 = none). Node ``i`` has address ``subnet``'s
    host ``i + 1`` on interface :data:`NODE_IFNAME` in namespace :func:`node_namespace`.
    """

    name: str
    nodes: int
    procs_per_node: int
    link_rate_bit_per_s: int
    subnet: str
    delay_s: float = 0.0
    phase: str = "creating"
    namespaces: list[str] = field(default_factory=list)
    # A cluster brought up for one job belongs to that job's process (pid, start time in clock
    # ticks); once that process is gone the cluster is stale. 0 = kept until 'down'.
    owner_pid: int = 0
    owner_start_ticks: int = 0

    def is_stale(self) -> bool:
        """Whether the job process that owned this cluster is gone (killed before its 'down')."""
        return bool(self.owner_pid) and process_start_ticks(self.owner_pid) != self.owner_start_ticks

    @property
    def path(self) -> Path:
        return state_dir() / f"{self.name}.json"

    @property
    def link(self) -> str:
        """The link rate as written on the command line (``1gbit``)."""
        return format_rate_bit_per_s(self.link_rate_bit_per_s)

    def address(self, node: int) -> str:
        """Node ``node``'s address inside its namespace (no prefix length)."""
        return str(ipaddress.ip_network(self.subnet)[node + 1])

    def planned_namespaces(self) -> list[str]:
        return [switch_namespace(self.name)] + [node_namespace(self.name, i) for i in range(self.nodes)]

    def save(self) -> Path:
        return write_json_atomic(self.path, asdict(self))

    @classmethod
    def load(cls, name: str) -> ClusterState | None:
        """The recorded state of cluster ``name``, or None when there is none.

        The file is input: it is read without following a symlink and checked
        (:meth:`problem`) before anything acts on it.

        Raises:
            ValueError: the file is unreadable or not a state of cluster ``name``, in one line.
        """
        path = state_dir() / f"{validate_name(name)}.json"
        advice = f"delete it and the namespaces starting with {owned_prefix(name)!r}"
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(f"cluster state file {path} cannot be opened ({exc.strerror}): {advice}") from None
        try:
            with os.fdopen(fd) as handle:
                data = json.loads(handle.read())
            state = cls(**data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cluster state file {path} is unreadable ({exc}): {advice}") from None
        problem = state.problem(name)
        if problem:
            raise ValueError(f"cluster state file {path} is invalid: {problem}: {advice}")
        return state

    def problem(self, name: str) -> str:
        """What makes this recorded state unfit to act on as cluster ``name``'s ('' when nothing)."""
        if self.name != name:
            return f"its name {self.name!r} is not the file's {name!r}"
        try:
            validate_shape(self.nodes, self.procs_per_node)
        except ValueError as exc:
            return str(exc)
        if not isinstance(self.link_rate_bit_per_s, int) or isinstance(self.link_rate_bit_per_s, bool) \
                or self.link_rate_bit_per_s <= 0:
            return f"link_rate_bit_per_s={self.link_rate_bit_per_s!r} is not a positive integer"
        if not isinstance(self.delay_s, (int, float)) or isinstance(self.delay_s, bool) or not 0 <= self.delay_s < 10:
            return f"delay_s={self.delay_s!r} is not a number of seconds in [0, 10)"
        if self.phase not in PHASES:
            return f"phase={self.phase!r} is not one of {', '.join(PHASES)}"
        try:
            ipaddress.ip_network(self.subnet)
        except (TypeError, ValueError):
            return f"subnet={self.subnet!r} is not a network"
        if not isinstance(self.namespaces, list) or not all(
                isinstance(ns, str) and ns.startswith(owned_prefix(name)) for ns in self.namespaces):
            return f"namespaces must all start with {owned_prefix(name)!r}"
        for key in ("owner_pid", "owner_start_ticks"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return f"{key}={value!r} is not a non-negative integer"
        return ""


def recorded_names() -> list[str]:
    """Names of every cluster with a state file, sorted."""
    directory = state_dir()
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


@contextmanager
def locked() -> Iterator[None]:
    """Hold the state directory's lock: one ``up``/``down`` at a time picks names and subnets."""
    directory = state_dir()
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    directory = state_dir()  # checked again now that it exists
    fd = open_private(directory / ".lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
