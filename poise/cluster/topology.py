"""Bring an emulated cluster up, take it down, and say what exists.

A cluster of N nodes is N+1 network namespaces: one per node and a "switch" holding a bridge.
Each node is joined to the bridge by a veth pair created directly inside the two namespaces
(the node end is ``eth0`` with the node's private address, the switch end ``n<i>``), so the
host's own namespace gains nothing. Each link is shaped in both directions by a tbf qdisc at
the link rate: egress of the node's ``eth0`` is its upload, egress of the switch's ``n<i>`` its
download. Traffic between two workers on the same node stays on that node (it never crosses
its link), as it would on a real machine.

See :mod:`poise.cluster.state` for how a crash mid-``up`` is cleaned by the next ``up``/``down``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import zlib
from dataclasses import dataclass

from poise.cluster import net
from poise.cluster.links import Shaping
from poise.cluster.state import (
    BRIDGE,
    NODE_IFNAME,
    ClusterState,
    locked,
    node_namespace,
    owned_prefix,
    recorded_names,
    switch_namespace,
    validate_shape,
)
from poise.config import validate_name

log = logging.getLogger(__name__)


def up(name: str, nodes: int, procs_per_node: int, rate_bit_per_s: int, delay_s: float = 0.0,
       owned_by_this_process: bool = False) -> ClusterState:
    """Create cluster ``name`` (or return it unchanged when it is already up with this shape).

    Clusters left behind by job processes that were killed are removed first.

    Args:
        rate_bit_per_s: each node link's rate, in each direction, bits per second.
        delay_s: one-way delay added to each direction, seconds (needs netem in the kernel).
        owned_by_this_process: the cluster belongs to this process (a job's own cluster): once
            the process is gone without taking it down, the next ``up`` removes it.

    Raises:
        ValueError: bad arguments, a cluster of that name with another shape, or a missing
            system piece (:class:`poise.cluster.net.NetError`), in one line.
    """
    validate_name(name)
    validate_shape(nodes, procs_per_node)
    net.require_support(delay=delay_s > 0)
    with locked():
        _remove_stale()
        existing = ClusterState.load(name)
        if existing is not None and existing.phase == "up":
            same = (existing.nodes, existing.procs_per_node, existing.link_rate_bit_per_s, existing.delay_s) == (
                nodes, procs_per_node, rate_bit_per_s, delay_s)
            if not same:
                raise ValueError(
                    f"cluster {name!r} is already up with {_describe(existing)}: "
                    f"run 'poise cluster down --name {name}' first"
                )
            present = set(net.list_namespaces())
            if all(ns in present for ns in existing.namespaces):
                log.info("cluster %s is already up", name)
                return existing
            log.warning("cluster %s lost some of its namespaces: rebuilding it", name)
        _remove(name, existing)
        state = ClusterState(name=name, nodes=nodes, procs_per_node=procs_per_node,
                             link_rate_bit_per_s=rate_bit_per_s, delay_s=delay_s, subnet=_free_subnet(name))
        if owned_by_this_process:
            state.owner_pid = os.getpid()
            state.owner_start_ticks = net.process_start_ticks(state.owner_pid) or 0
        # Recorded before the first object exists: whatever happens next, down finds it all.
        state.namespaces = state.planned_namespaces()
        state.save()
        try:
            _build(state)
        except BaseException:
            _remove(name, state)
            raise
        state.phase = "up"
        state.save()
    log.info("cluster %s is up: %s", name, _describe(state))
    return state


def down(name: str) -> list[str]:
    """Remove cluster ``name``: stop processes inside it, delete its namespaces and state.
    Clusters left behind by killed jobs are removed as well.

    Returns:
        The namespaces of ``name`` deleted (empty when there was nothing: ``down`` twice is fine).
    """
    validate_name(name)
    net.require_root()
    net.require_tools()
    with locked():
        _remove_stale()
        return _remove(name, ClusterState.load(name))


def down_all() -> list[str]:
    """Remove every poise cluster, recorded or orphaned; returns the namespaces deleted."""
    net.require_root()
    net.require_tools()
    removed: list[str] = []
    with locked():
        for name in recorded_names():
            removed += _remove(name, ClusterState.load(name))
        for ns in net.list_namespaces():
            if ns.startswith(net.NS_PREFIX) and net.delete_namespace(ns):
                removed.append(ns)
    return removed


@dataclass(frozen=True)
class ClusterStatus:
    """What exists of one cluster: its recorded state (None for orphaned namespaces), the
    namespaces that exist, those recorded but missing, and processes running inside."""

    name: str
    state: ClusterState | None
    present: list[str]
    missing: list[str]
    num_processes: int

    @property
    def healthy(self) -> bool:
        return self.state is not None and self.state.phase == "up" and not self.missing


def status() -> list[ClusterStatus]:
    """Every cluster with a state file, and every other namespace with the poise prefix."""
    net.require_root()
    net.require_tools()
    present_all = [ns for ns in net.list_namespaces() if ns.startswith(net.NS_PREFIX)]
    out = []
    claimed: set[str] = set()
    for name in recorded_names():
        state = ClusterState.load(name)
        assert state is not None
        mine = [ns for ns in present_all if ns.startswith(owned_prefix(name))]
        claimed.update(mine)
        missing = [ns for ns in state.namespaces if ns not in mine]
        pids = sum(len(net.namespace_pids(ns)) for ns in mine)
        out.append(ClusterStatus(name, state, mine, missing, pids))
    orphans: dict[str, list[str]] = {}
    for ns in present_all:
        if ns not in claimed:
            orphans.setdefault(ns.removeprefix(net.NS_PREFIX).rsplit("-", 1)[0], []).append(ns)
    for name, namespaces in orphans.items():
        out.append(ClusterStatus(name, None, namespaces, [], sum(len(net.namespace_pids(n)) for n in namespaces)))
    return out


def _describe(state: ClusterState) -> str:
    delay = f", {state.delay_s * 1e3:g} ms delay" if state.delay_s else ""
    return f"{state.nodes} node(s) x {state.procs_per_node} worker(s), {state.link} links{delay}, {state.subnet}"


def _build(state: ClusterState) -> None:
    shaping = Shaping.for_rate(state.link_rate_bit_per_s, state.delay_s)
    prefix_len = ipaddress.ip_network(state.subnet).prefixlen
    sw = switch_namespace(state.name)
    net.run("ip", "netns", "add", sw)
    net.run("ip", "-n", sw, "link", "set", "lo", "up")
    net.run("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")
    net.run("ip", "-n", sw, "link", "set", BRIDGE, "up")
    for node in range(state.nodes):
        ns, port = node_namespace(state.name, node), f"n{node}"
        net.run("ip", "netns", "add", ns)
        net.run("ip", "-n", ns, "link", "set", "lo", "up")
        # Both ends are created inside their namespaces: the host's namespace never holds them.
        net.run("ip", "link", "add", NODE_IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw)
        net.run("ip", "-n", sw, "link", "set", port, "master", BRIDGE)
        net.run("ip", "-n", sw, "link", "set", port, "up")
        net.run("ip", "-n", ns, "addr", "add", f"{state.address(node)}/{prefix_len}", "dev", NODE_IFNAME)
        net.run("ip", "-n", ns, "link", "set", NODE_IFNAME, "up")
        for where, dev in ((ns, NODE_IFNAME), (sw, port)):  # upload, download
            for args in shaping.tc_args(dev):
                net.run("tc", "-n", where, *args)


def _remove_stale() -> None:
    for other in recorded_names():
        state = ClusterState.load(other)
        if state is not None and state.is_stale():
            log.warning("removing cluster %s: the job process %d that brought it up is gone", other, state.owner_pid)
            _remove(other, state)


def _remove(name: str, state: ClusterState | None) -> list[str]:
    """Delete the recorded namespaces and any other with the cluster's prefix, then the state."""
    namespaces = list(state.namespaces) if state else []
    prefix = owned_prefix(name)
    namespaces += [ns for ns in net.list_namespaces() if ns.startswith(prefix) and ns not in namespaces]
    # Nodes first, the switch last: a node's link then never dangles from a deleted bridge.
    namespaces.sort(key=lambda ns: ns == switch_namespace(name))
    removed = [ns for ns in namespaces if net.delete_namespace(ns)]
    if state is not None:
        state.path.unlink(missing_ok=True)
    if removed:
        log.info("cluster %s: deleted %s", name, ", ".join(removed))
    return removed


def _free_subnet(name: str) -> str:
    """A 10.X.Y.0/24 that overlaps no route of this host and no other recorded cluster.

    The cluster's namespaces are isolated, so a clash would not misroute anything; avoiding
    one keeps addresses unambiguous for whoever reads logs or ``ip`` output.
    """
    taken = [ipaddress.ip_network(s) for s in _host_networks()]
    for other in recorded_names():
        state = ClusterState.load(other)
        if state is not None and other != name:
            taken.append(ipaddress.ip_network(state.subnet))
    start = zlib.crc32(name.encode()) % 65536
    for k in range(65536):
        index = (start + k) % 65536
        candidate = ipaddress.ip_network(f"10.{index >> 8}.{index & 255}.0/24")
        if not any(candidate.overlaps(t) for t in taken):
            return str(candidate)
    raise ValueError("no free 10.X.Y.0/24 subnet is left for a cluster: every one overlaps a route of this host")


def _host_networks() -> list[str]:
    """Destinations of the host's IPv4 routes, in every table ('default' is left out)."""
    networks = []
    for line in net.run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in ("broadcast", "local", "unicast", "multicast"):
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            networks.append(str(ipaddress.ip_network(words[0], strict=False)))
        except ValueError:
            continue
    return networks
