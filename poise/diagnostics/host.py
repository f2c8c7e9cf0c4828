"""``poise diagnose host``: read-only checks of the settings that shape a job's network and CPU use.

Each check gives the current value, the recommended one, the command that sets it and why.
Nothing here changes the host: it reads ``/proc/sys``, ``/proc/net/route``, ``/sys/class/net``
and the environment (the roots are arguments, so tests run on a fake tree).

Why these: gradient all-reduces are bursts of large messages with idle gaps between them.
Small socket buffer limits cap what one TCP connection can have in flight (gloo and NCCL's
socket transport are TCP); ``tcp_slow_start_after_idle`` restarts the congestion window after
every gap, so every step's burst starts slow; window scaling off caps the window at 64 KiB.
A job on the wrong interface (a socket-ifname that names no routed interface) runs over a
slower or dead path; too many CPU threads per worker make workers on one machine fight for cores.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RECOMMENDED_SOCKET_BUFFER_BYTES = 16 * 2**20  # enough in flight for ~10 Gbit/s at ~10 ms round trip
NCCL_DEBUG_SETTINGS = "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,COLL TORCH_DISTRIBUTED_DEBUG=DETAIL"


@dataclass(frozen=True)
class HostCheck:
    """One host setting: what it is, what we recommend, how to set it, and ``verdict``
    (``ok``, ``warn``, or ``info`` for advice that depends on what you are doing)."""

    name: str
    current: str
    recommended: str
    command: str
    verdict: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def routes(proc: Path = Path("/proc")) -> list[tuple[str, bool]]:
    """``(interface, is_default)`` for every IPv4 route of ``/proc/net/route``."""
    text = _read(proc / "net" / "route") or ""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1] == "00000000"))
    return out


def job_interface(env: Mapping[str, str], proc: Path = Path("/proc"), ifname: str = "") -> str | None:
    """The interface a job's sockets use: ``ifname``, else ``GLOO_SOCKET_IFNAME``'s first exact
    name, else the default route's interface (what a rendezvous over the network takes)."""
    if ifname:
        return ifname
    gloo = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if gloo:
        return gloo
    return next((i for i, default in routes(proc) if default), None)


def _sysctl(proc: Path, key: str, recommended: int, why: str, *, at_least: bool) -> HostCheck:
    value = _read(proc / "sys" / Path(*key.split(".")))
    command = f"sysctl -w {key}={recommended}  (persist in /etc/sysctl.d/90-poise.conf)"
    if value is None:
        return HostCheck(key, "unreadable", str(recommended), command, "info", why)
    try:
        number = int(value.split()[0])
    except ValueError:
        return HostCheck(key, value, str(recommended), command, "info", why)
    good = number >= recommended if at_least else number == recommended
    return HostCheck(key, value, f">= {recommended}" if at_least else str(recommended), command,
                     "ok" if good else "warn", why)


def _ifname_matches(spec: str, name: str) -> bool:
    """Whether NCCL-style ``spec`` (``eth``, ``=eth0``, ``^docker,lo``, comma lists) selects ``name``."""
    spec = spec.strip()
    if spec.startswith("^"):
        return not any(_ifname_matches(p, name) for p in spec[1:].split(",") if p)
    exact = spec.startswith("=")
    parts = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]
    return any(name == p if exact else name.startswith(p) for p in parts)


def _ifname_check(var: str, env: Mapping[str, str], proc: Path, sys_net: Path) -> HostCheck:
    routed = sorted({i for i, _ in routes(proc)})
    default = next((i for i, d in routes(proc) if d), None)
    present = sorted(p.name for p in sys_net.iterdir()) if sys_net.is_dir() else []
    spec = env.get(var, "")
    command = f"export {var}={default or '<interface>'}"
    why = (f"the interface {var.split('_')[0].lower()} binds its sockets to; it must be up and carry the route "
           "to the other nodes")
    if not spec:
        return HostCheck(var, "unset (the backend picks one)", default or "the interface of the route to the peers",
                         command, "info", why)
    chosen = [n for n in present if _ifname_matches(spec, n)] if var == "NCCL_SOCKET_IFNAME" else \
        [n for n in spec.split(",") if n.strip() in present]
    unrouted = [n for n in chosen if n not in routed]
    if not chosen:
        return HostCheck(var, f"{spec} (matches no interface; present: {', '.join(present)})", default or "-",
                         command, "warn", why)
    state = {n: _read(sys_net / n / "operstate") or "?" for n in chosen}
    down = [n for n, s in state.items() if s not in ("up", "unknown")]
    if unrouted or down:
        what = ", ".join([f"{n} has no route" for n in unrouted] + [f"{n} is {state[n]}" for n in down])
        return HostCheck(var, f"{spec} ({what})", default or "-", command, "warn", why)
    return HostCheck(var, f"{spec} ({', '.join(chosen)}, routed, up)", spec, command, "ok", why)


def check_host(*, nproc: int = 2, ifname: str = "", env: Mapping[str, str] | None = None,
               proc: Path = Path("/proc"), sys_net: Path = Path("/sys/class/net"),
               cores: int | None = None) -> list[HostCheck]:
    """All checks, in a fixed order. ``nproc``: workers per machine the job will run (for the
    CPU threads check); ``ifname``: the job's interface if known.

    Raises:
        ValueError: for ``nproc`` < 1.
    """
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be >= 1")
    env = os.environ if env is None else env
    cores = cores or len(os.sched_getaffinity(0))
    checks = [
        _sysctl(proc, "net.core.rmem_max", RECOMMENDED_SOCKET_BUFFER_BYTES,
                "largest receive buffer a socket may ask for: caps the bytes in flight per connection", at_least=True),
        _sysctl(proc, "net.core.wmem_max", RECOMMENDED_SOCKET_BUFFER_BYTES,
                "largest send buffer a socket may ask for: caps the bytes in flight per connection", at_least=True),
        _sysctl(proc, "net.ipv4.tcp_slow_start_after_idle", 0,
                "1 shrinks the congestion window after each idle gap, so every step's gradient burst starts slow",
                at_least=False),
        _sysctl(proc, "net.ipv4.tcp_window_scaling", 1,
                "0 caps the TCP window at 64 KiB, far below a fast link's bandwidth-delay product", at_least=False),
    ]
    iface = job_interface(env, proc, ifname)
    mtu = _read(sys_net / iface / "mtu") if iface else None
    mtu_why = ("larger frames cost less CPU per byte; 9000 (jumbo) only where every NIC and switch on the path "
               "takes it, or packets are dropped")
    if iface is None or mtu is None:
        checks.append(HostCheck("mtu", f"unknown (interface {iface or 'not found'})", "1500, or 9000 end to end",
                                "ip link set dev <interface> mtu 9000", "info", mtu_why))
    else:
        value = int(mtu)
        checks.append(HostCheck(f"mtu of {iface}", str(value), "1500, or 9000 end to end",
                                f"ip link set dev {iface} mtu 9000", "warn" if value < 1500 else "ok", mtu_why))
    checks.append(_ifname_check("GLOO_SOCKET_IFNAME", env, proc, sys_net))
    checks.append(_ifname_check("NCCL_SOCKET_IFNAME", env, proc, sys_net))
    debug = " ".join(f"{k}={env[k]}" for k in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "TORCH_DISTRIBUTED_DEBUG")
                     if env.get(k)) or "unset"
    checks.append(HostCheck("NCCL debug", debug, f"{NCCL_DEBUG_SETTINGS} (only while chasing a problem: it is verbose)",
                            f"export {NCCL_DEBUG_SETTINGS}", "info",
                            "logs which interface, transport and algorithm each collective uses, and init failures"))
    per_worker = max(1, cores // nproc)
    omp = env.get("OMP_NUM_THREADS", "")
    try:
        threads = int(omp) if omp else None
    except ValueError:
        threads = None
    over = threads is not None and threads * nproc > cores
    current = (f"OMP_NUM_THREADS={omp}" if omp else f"OMP_NUM_THREADS unset (torch takes all {cores} cores per "
               "process; poise train sets dist.threads_per_worker itself)")
    checks.append(HostCheck(f"CPU threads per worker ({nproc} workers, {cores} cores)", current, str(per_worker),
                            f"export OMP_NUM_THREADS={per_worker}  (poise train: --dist.threads_per_worker "
                            f"{per_worker})", "warn" if over else "ok" if threads else "info",
                            "workers on one machine that together run more threads than cores slow each other "
                            "down and make step times noisy"))
    return checks


__all__ = ["HostCheck", "check_host", "job_interface", "routes"]
