"""Measure an emulated cluster's links: a timed TCP transfer between two node namespaces.

The front end (:func:`check_links`) runs a receiver in one node's namespace and a sender in
another's, both this module run as ``python -m poise.cluster.linkcheck recv|send``; the
receiver times from its first byte to the end of the stream. Each node sends to the next
(0 -> 1 -> ... -> 0), so every link's upload and download is measured once. The payload rate
sits a few percent under the configured line rate: TCP/IP headers ride the same shaped link.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from poise.cluster import net
from poise.cluster.state import ClusterState, node_namespace

PORT = 5201
_CHUNK_BYTES = 1 << 20
# By default a check moves 64 MB, or less when the link would need longer than this for it.
DEFAULT_MAX_BYTES = 64 * 10**6
_DEFAULT_MAX_S = 3.0


@dataclass(frozen=True)
class LinkMeasurement:
    """One transfer: ``num_bytes`` of payload from node ``src`` to node ``dst`` in ``seconds``."""

    src: int
    dst: int
    num_bytes: int
    seconds: float
    line_rate_bit_per_s: int

    @property
    def payload_bit_per_s(self) -> float:
        return self.num_bytes * 8 / self.seconds

    @property
    def fraction_of_line_rate(self) -> float:
        return self.payload_bit_per_s / self.line_rate_bit_per_s


def default_num_bytes(rate_bit_per_s: int) -> int:
    """64 MB, or what the link carries in 3 s when that is less (bytes)."""
    return max(_CHUNK_BYTES, min(DEFAULT_MAX_BYTES, int(rate_bit_per_s / 8 * _DEFAULT_MAX_S)))


def check_links(state: ClusterState, num_bytes: int) -> list[LinkMeasurement]:
    """Time one transfer of ``num_bytes`` from every node to the next, one after another.

    Raises:
        ValueError: with fewer than 2 nodes, while a job runs on the cluster, or when a
            transfer fails or does not finish in time.
    """
    if state.nodes < 2:
        raise ValueError(f"cluster {state.name!r} has {state.nodes} node: checking a link needs at least 2")
    if num_bytes < 1:
        raise ValueError(f"bytes={num_bytes} must be positive")
    busy = [ns for i in range(state.nodes) if net.namespace_pids(ns := node_namespace(state.name, i))]
    if busy:
        raise ValueError(f"cluster {state.name!r} is busy (processes in {', '.join(busy)}): a check would be skewed")
    # The slowest acceptable transfer runs at a tenth of the line rate, plus start-up.
    timeout_s = 10 * num_bytes * 8 / state.link_rate_bit_per_s + 30
    return [_transfer(state, src, (src + 1) % state.nodes, num_bytes, timeout_s) for src in range(state.nodes)]


def _endpoint(state: ClusterState, node: int, *args: str) -> list[str]:
    return ["ip", "netns", "exec", node_namespace(state.name, node), sys.executable, "-m", __name__, *args]


def _transfer(state: ClusterState, src: int, dst: int, num_bytes: int, timeout_s: float) -> LinkMeasurement:
    address = state.address(dst)
    receiver = subprocess.Popen(_endpoint(state, dst, "recv", "--bind", address, "--port", str(PORT)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise ValueError(f"link check: the receiver on node {dst} did not start: {receiver.stderr.read().strip()}")
        sender = subprocess.run(
            _endpoint(state, src, "send", "--to", address, "--port", str(PORT), "--bytes", str(num_bytes)),
            capture_output=True, text=True, timeout=timeout_s,
        )
        if sender.returncode != 0:
            raise ValueError(f"link check: sending from node {src} to node {dst} failed: {sender.stderr.strip()}")
        out, _ = receiver.communicate(timeout=30)
        result = json.loads(out)
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"link check: {num_bytes} bytes from node {src} to node {dst} took over {timeout_s:.0f} s"
        ) from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    if result["bytes"] != num_bytes:
        raise ValueError(f"link check: node {dst} received {result['bytes']} of {num_bytes} bytes from node {src}")
    return LinkMeasurement(src, dst, num_bytes, result["seconds"], state.link_rate_bit_per_s)


def _receive(bind: str, port: int) -> None:
    """Accept one connection, read it to the end, print {"bytes", "seconds"} as JSON."""
    with socket.create_server((bind, port)) as server:
        server.settimeout(60)
        _reply("ready")
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(_CHUNK_BYTES)
            num_bytes, started = 0, None
            while count := conn.recv_into(buffer):
                if started is None:
                    started = time.perf_counter()
                num_bytes += count
            seconds = time.perf_counter() - started if started is not None else 0.0
    _reply(json.dumps({"bytes": num_bytes, "seconds": seconds}))


def _reply(line: str) -> None:
    """One line to the front end, which reads this end's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _send(to: str, port: int, num_bytes: int) -> None:
    chunk = bytes(_CHUNK_BYTES)
    with socket.create_connection((to, port), timeout=60) as conn:
        left = num_bytes
        while left > 0:
            conn.sendall(chunk[: min(left, _CHUNK_BYTES)])
            left -= _CHUNK_BYTES


def main(argv: list[str] | None = None) -> int:
    """The two ends of a transfer, run inside node namespaces by :func:`check_links`."""
    parser = argparse.ArgumentParser(prog="poise.cluster.linkcheck")
    sub = parser.add_subparsers(dest="role", required=True)
    recv = sub.add_parser("recv")
    recv.add_argument("--bind", required=True)
    recv.add_argument("--port", type=int, required=True)
    send = sub.add_parser("send")
    send.add_argument("--to", required=True)
    send.add_argument("--port", type=int, required=True)
    send.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    if args.role == "recv":
        _receive(args.bind, args.port)
    else:
        _send(args.to, args.port, args.bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
