"""``poise diagnose <what>``: measure the job's own hardware and network, print a table, write JSON.

Diagnostics are listed in one dict. Each module exposes ``HELP``, ``add_arguments(parser)``
(its measurement options), ``check_arguments(args)`` (one-line ValueErrors before anything
starts), ``forwarded_argv(args)`` and a ``main(argv)`` that runs on every worker; this
command starts the workers with torch's elastic launcher, exactly as ``poise train`` does.
Inside a job of your own, run the module directly: ``torchrun ... -m poise.diagnostics.busbw``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType
from typing import Any

from poise import config as cfg
from poise.cluster import job as cluster_job
from poise.diagnostics import busbw
from poise.launch.job import launch_job

DIAGNOSTICS: dict[str, ModuleType] = {"busbw": busbw}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("diagnose", help="measure this job's network: prints a table and writes JSON")
    kinds = parser.add_subparsers(dest="diagnostic", required=True, parser_class=type(parser))
    for name, module in DIAGNOSTICS.items():
        kind = kinds.add_parser(name, help=module.HELP, description=module.__doc__.splitlines()[0])
        module.add_arguments(kind)
        launcher = kind.add_argument_group("launch (as poise train)")
        launcher.add_argument("--nproc", type=int, default=2, help="worker processes on this machine, default 2")
        launcher.add_argument("--nnodes", default="1", help="number of machines (multi-node: with --rdzv-endpoint)")
        launcher.add_argument("--node-rank", type=int, default=None, help="this machine's rank")
        launcher.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous for multi-node jobs")
        launcher.add_argument("--cluster", default="", metavar="N:M",
                              help="run on an emulated cluster of N nodes x M workers (see poise cluster; root)")
        launcher.add_argument("--cluster-name", default="", help="run on this cluster from 'poise cluster up'")
        kind.set_defaults(run=run, module=module)


def run(args: argparse.Namespace) -> int:
    module: ModuleType = args.module
    module.check_arguments(args)
    # absolute, so every worker (and node) writes to the same place
    args.out = str(Path(args.out or module.default_out_dir()).resolve())
    config = cfg.from_dict({"out_dir": args.out, "dist": _dist_settings(args), "cluster": _cluster_settings(args)})
    if config.cluster.enabled:
        cluster_job.check_job(config)
    return launch_job(config, None, module=module.__name__, command=f"diagnose {args.diagnostic}",
                      module_args=module.forwarded_argv(args))


def _dist_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings = {"nproc": args.nproc, "nnodes": args.nnodes, "rdzv_endpoint": args.rdzv_endpoint,
                "backend": args.backend}
    if args.node_rank is not None:
        settings["node_rank"] = args.node_rank
    if args.cluster:
        per_node = args.cluster.partition(":")[2]
        if per_node:
            settings["nproc"] = per_node  # coerced and checked by the config
    return settings


def _cluster_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--cluster N:M and --cluster-name as the [cluster] section; --link is the cluster's link
    rate too when a cluster is asked for (busbw also uses it for the line-rate ratio)."""
    if not (args.cluster or args.cluster_name):
        return {}
    settings: dict[str, Any] = {"name": args.cluster_name}
    if args.cluster:
        nodes = args.cluster.partition(":")[0]
        if not nodes.isdigit():
            raise ValueError(f"--cluster {args.cluster!r} is invalid: give N[:M], positive integers")
        settings["nodes"] = int(nodes)
    if getattr(args, "link", ""):
        settings["link"] = args.link
    return settings
