"""``poise diagnose host``'s checks on a fake /proc and /sys tree (read-only, no real host needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from poise.diagnostics.host import check_host, job_interface

ROUTES = ("Iface\tDestination\tGateway\tFlags\n"
          "eth0\t00000000\t010200C0\t0003\n"
          "eth0\t000200C0\t00000000\t0001\n"
          "ib0\t000A0A0A\t00000000\t0001\n")


def fake_host(tmp_path: Path, *, rmem: str = "212992", slow_start: str = "1") -> tuple[Path, Path]:
    proc, sys_net = tmp_path / "proc", tmp_path / "net"
    values = {"net/core/rmem_max": rmem, "net/core/wmem_max": "16777216",
              "net/ipv4/tcp_slow_start_after_idle": slow_start, "net/ipv4/tcp_window_scaling": "1"}
    for key, value in values.items():
        (proc / "sys" / key).parent.mkdir(parents=True, exist_ok=True)
        (proc / "sys" / key).write_text(value + "\n")
    (proc / "net").mkdir(parents=True)
    (proc / "net" / "route").write_text(ROUTES)
    interfaces = (("eth0", "9000", "up"), ("ib0", "2044", "up"), ("docker0", "1500", "down"),
                  ("lo", "65536", "unknown"))
    for name, mtu, state in interfaces:
        (sys_net / name).mkdir(parents=True)
        (sys_net / name / "mtu").write_text(mtu)
        (sys_net / name / "operstate").write_text(state)
    return proc, sys_net


def checks(tmp_path: Path, env: dict[str, str], **kw) -> dict:
    proc, sys_net = fake_host(tmp_path, **kw)
    return {c.name.split(" (")[0]: c for c in check_host(nproc=4, env=env, proc=proc, sys_net=sys_net, cores=8)}


def test_sysctls_current_recommended_and_command(tmp_path):
    found = checks(tmp_path, {})
    rmem = found["net.core.rmem_max"]
    assert (rmem.current, rmem.verdict) == ("212992", "warn") and rmem.recommended == ">= 16777216"
    assert rmem.command.startswith("sysctl -w net.core.rmem_max=16777216")
    assert found["net.core.wmem_max"].verdict == "ok"
    assert found["net.ipv4.tcp_slow_start_after_idle"].verdict == "warn"
    assert found["net.ipv4.tcp_window_scaling"].verdict == "ok"
    assert found["mtu of eth0"].current == "9000"  # the default route's interface


def test_socket_ifname_against_routes_and_nccl_prefix_syntax(tmp_path):
    found = checks(tmp_path, {"GLOO_SOCKET_IFNAME": "docker0", "NCCL_SOCKET_IFNAME": "^docker,lo"})
    gloo = found["GLOO_SOCKET_IFNAME"]
    assert gloo.verdict == "warn" and "docker0 has no route" in gloo.current and gloo.recommended == "eth0"
    nccl = found["NCCL_SOCKET_IFNAME"]
    assert nccl.verdict == "ok" and "eth0" in nccl.current and "ib0" in nccl.current
    missing = checks(tmp_path / "b", {"NCCL_SOCKET_IFNAME": "=wlan0"})["NCCL_SOCKET_IFNAME"]
    assert missing.verdict == "warn" and "matches no interface" in missing.current


def test_threads_per_worker_and_debug_variables(tmp_path):
    found = checks(tmp_path, {"OMP_NUM_THREADS": "4", "NCCL_DEBUG": "WARN"})
    threads = found["CPU threads per worker"]
    assert threads.verdict == "warn" and threads.recommended == "2" and "OMP_NUM_THREADS=2" in threads.command
    debug = found["NCCL debug"]
    assert debug.current == "NCCL_DEBUG=WARN" and "NCCL_DEBUG_SUBSYS" in debug.command and debug.verdict == "info"


def test_job_interface_order_and_bad_nproc(tmp_path):
    proc, _ = fake_host(tmp_path)
    assert job_interface({}, proc) == "eth0"
    assert job_interface({"GLOO_SOCKET_IFNAME": "ib0,eth0"}, proc) == "ib0"
    assert job_interface({}, proc, ifname="lo") == "lo"
    with pytest.raises(ValueError, match="--nproc=0 must be >= 1"):
        check_host(nproc=0)
