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
from poise.cli.train import launch
from poise.diagnostics import busbw

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
        kind.set_defaults(run=run, module=module)


def run(args: argparse.Namespace) -> int:
    module: ModuleType = args.module
    module.check_arguments(args)
    dist = cfg.DistConfig(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                          rdzv_endpoint=args.rdzv_endpoint, backend=args.backend)
    # absolute, so every worker (and node) writes to the same place
    args.out = str(Path(args.out or module.default_out_dir()).resolve())
    return launch(dist, None, module=module.__name__, command=f"diagnose {args.diagnostic}",
                  module_args=module.forwarded_argv(args))
