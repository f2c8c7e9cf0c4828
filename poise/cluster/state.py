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
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from poise.cluster.net import NS_PREFIX, process_start_ticks
from poise.files import write_json_atomic
from poise.units import format_rate_bit_per_s

DEFAULT_STATE_DIR = "/run/poise/clusters"
MAX_NODES = 64
MAX_PROCS_PER_NODE = 64
# Lower-case letters, digits and '_': never '-', so "poise-<name>-" prefixes cannot overlap.
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
# Inside every node namespace the link has the same name, so one GLOO_SOCKET_IFNAME fits all.
NODE_IFNAME = "eth0"
BRIDGE = "br0"
PHASES = ("creating", "up")


def state_dir() -> Path:
    """Where cluster state files live (``$POISE_CLUSTER_STATE_DIR`` or /run/poise/clusters)."""
    return Path(os.environ.get("POISE_CLUSTER_STATE_DIR") or DEFAULT_STATE_DIR)


def validate_name(name: str) -> str:
    """Returns ``name``; raises ValueError unless it is 1-32 of a-z, 0-9, '_' starting with a letter."""
    if not _NAME.match(name):
        raise ValueError(
            f"cluster name {name!r} is invalid: use 1-32 lower-case letters, digits or '_', starting with a letter"
        )
    return name


def validate_shape(nodes: int, procs_per_node: int) -> None:
    """Raises ValueError unless 1 <= nodes <= 64 and 1 <= procs_per_node <= 64."""
    if isinstance(nodes, bool) or not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes={nodes!r} is invalid: allowed is 1..{MAX_NODES}")
    if isinstance(procs_per_node, bool) or not 1 <= procs_per_node <= MAX_PROCS_PER_NODE:
        raise ValueError(f"procs_per_node={procs_per_node!r} is invalid: allowed is 1..{MAX_PROCS_PER_NODE}")


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
        """The recorded state of cluster ``name``, or None when there is none."""
        path = state_dir() / f"{validate_name(name)}.json"
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"cluster state file {path} is unreadable ({exc}): delete it and the "
                             f"namespaces starting with {owned_prefix(name)!r}") from None


def recorded_names() -> list[str]:
    """Names of every cluster with a state file, sorted."""
    directory = state_dir()
    return sorted(p.stem for p in directory.glob("*.json")) if directory.is_dir() else []


@contextmanager
def locked() -> Iterator[None]:
    """Hold the state directory's lock: one ``up``/``down`` at a time picks names and subnets."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
