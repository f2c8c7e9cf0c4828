"""``poise cluster up|down|status|check|run``: an emulated multi-node cluster on this machine.

See :mod:`poise.cluster` for what a cluster is made of. ``run`` is ``poise train`` on an existing
cluster: ``poise cluster run --name c1 -- poise train --task digits`` (``poise train --cluster
N:M`` instead brings a cluster up for one job and takes it down after).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from poise.cli import train
from poise.cluster import linkcheck, topology
from poise.cluster.state import ClusterState
from poise.files import write_json_atomic
from poise.log import make_console
from poise.units import link_delay_s, link_rate_bit_per_s

DEFAULT_NAME = "default"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("cluster", help="an emulated multi-node cluster: namespaces and shaped links (root)")
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))

    up = actions.add_parser("up", help="create a cluster (unchanged if it is already up with this shape)")
    up.add_argument("--nodes", type=int, required=True, help="number of nodes (network namespaces), 1..64")
    up.add_argument("--procs-per-node", type=int, default=1, help="default workers per node for jobs on it")
    up.add_argument("--link", default="1gbit", help="rate of every node's link, each direction (e.g. 100mbit)")
    up.add_argument("--delay", default="", help="one-way delay per direction, e.g. 2ms (needs the kernel's netem)")
    up.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME!r})")
    up.set_defaults(run=_up)

    down = actions.add_parser("down", help="stop what runs in a cluster and remove it (fine if already gone)")
    which = down.add_mutually_exclusive_group()
    which.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME!r})")
    which.add_argument("--all", action="store_true", help="every poise cluster, and leftovers of crashed ones")
    down.set_defaults(run=_down)

    status = actions.add_parser("status", help="list clusters, their links and what runs in them")
    status.set_defaults(run=_status)

    check = actions.add_parser("check", help="measure every node's link with a timed TCP transfer")
    check.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME!r})")
    check.add_argument("--megabytes", type=float, default=0.0,
                       help="payload per transfer in MB (default: 64, less when the link needs over 3 s)")
    check.add_argument("--json", default="", metavar="FILE", help="also write the measurements here")
    check.set_defaults(run=_check)

    run = actions.add_parser("run", help="run 'poise train ...' across a cluster's nodes",
                             description="poise cluster run [--name NAME] -- poise train [train flags]")
    run.add_argument("--name", default=DEFAULT_NAME, help=f"cluster name (default {DEFAULT_NAME!r})")
    run.add_argument("train_command", nargs=argparse.REMAINDER, metavar="-- poise train [flags]")
    run.set_defaults(run=_run)


def _up(args: argparse.Namespace) -> int:
    state = topology.up(args.name, args.nodes, args.procs_per_node, link_rate_bit_per_s(args.link),
                         link_delay_s(args.delay))
    _show([status for status in topology.status() if status.name == state.name])
    return 0


def _down(args: argparse.Namespace) -> int:
    removed = topology.down_all() if args.all else topology.down(args.name)
    what = "every cluster" if args.all else f"cluster {args.name!r}"
    make_console().print(f"{what}: removed {len(removed)} namespace(s)" if removed else f"{what}: nothing to remove")
    return 0


def _status(args: argparse.Namespace) -> int:
    statuses = topology.status()
    if not statuses:
        make_console().print("no clusters")
        return 0
    _show(statuses)
    return 0


def _show(statuses: list[topology.ClusterStatus]) -> None:
    from rich.table import Table

    table = Table(title="poise clusters")
    for header in ("name", "state", "nodes", "workers/node", "link", "delay", "subnet", "processes"):
        table.add_column(header)
    for s in statuses:
        st = s.state
        if st is None:
            condition = f"orphaned: {len(s.present)} namespace(s), no state ('poise cluster down --all')"
        elif st.is_stale():
            condition = f"stale: job process {st.owner_pid} is gone (the next 'up' or 'down' removes it)"
        elif st.phase != "up":
            condition = f"{st.phase} (interrupted: run 'poise cluster down --name {s.name}')"
        else:
            condition = "up" if s.healthy else f"broken: missing {', '.join(s.missing)}"
        table.add_row(s.name, condition, *(("-",) * 5 if st is None else (
            str(st.nodes), str(st.procs_per_node), st.link, f"{st.delay_s * 1e3:g} ms" if st.delay_s else "-",
            f"{st.subnet} (node i: .{{i+1}})")), str(s.num_processes))
    make_console().print(table)


def _check(args: argparse.Namespace) -> int:
    state = ClusterState.load(args.name)
    if state is None or state.phase != "up":
        raise ValueError(f"cluster {args.name!r} is not up: start it with 'poise cluster up --name {args.name} ...'")
    num_bytes = int(args.megabytes * 1e6) if args.megabytes else linkcheck.default_num_bytes(state.link_rate_bit_per_s)
    results = linkcheck.check_links(state, num_bytes)
    from rich.table import Table

    table = Table(title=f"cluster {state.name}: TCP payload over {state.link} links")
    for header in ("from", "to", "MB", "seconds", "Mbit/s", "x line rate"):
        table.add_column(header, justify="right")
    for r in results:
        table.add_row(f"node {r.src}", f"node {r.dst}", f"{r.num_bytes / 1e6:.1f}", f"{r.seconds:.3f}",
                      f"{r.payload_bit_per_s / 1e6:.1f}", f"{r.fraction_of_line_rate:.3f}")
    console = make_console()
    console.print(table)
    if args.json:
        path = write_json_atomic(Path(args.json), {
            "cluster": state.name, "link": state.link, "link_rate_bit_per_s": state.link_rate_bit_per_s,
            "transfers": [{**dataclasses.asdict(r), "payload_bit_per_s": r.payload_bit_per_s,
                           "fraction_of_line_rate": r.fraction_of_line_rate} for r in results],
        })
        console.print(f"wrote {path}")
    return 0


def _run(args: argparse.Namespace) -> int:
    command = list(args.train_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if command[:2] == ["poise", "train"]:
        command = command[2:]
    elif command[:1] == ["train"]:
        command = command[1:]
    else:
        raise ValueError(f"poise cluster run runs 'poise train ...', not {' '.join(command)!r}: "
                         f"give it after '--', e.g. poise cluster run --name {args.name} -- poise train --task digits")
    parser = argparse.ArgumentParser(prog="poise train")
    sub = parser.add_subparsers()
    train.add_parser(sub)
    train_args = parser.parse_args(["train", *command, "--cluster.name", args.name])
    return int(train_args.run(train_args))
