"""``poise diagnose <what>``: measure the job's own hardware and network, or read what a run wrote.

Two kinds, each listed in one dict:

- measurements that run on workers (:data:`DIAGNOSTICS`: ``busbw``). Each module exposes
  ``HELP``, ``add_arguments(parser)`` (its measurement options), ``check_arguments(args)``
  (one-line ValueErrors before anything starts), ``forwarded_argv(args)`` and a ``main(argv)``
  that runs on every worker; this command starts the workers with torch's elastic launcher,
  exactly as ``poise train`` does. Inside a job of your own, run the module directly:
  ``torchrun ... -m poise.diagnostics.busbw``.
- checks in this process (:data:`LOCAL`): ``run DIR`` (the rules of
  ``poise/diagnostics/rules.py`` over a finished run's report.json and timeline.npz) and
  ``host`` (read-only host settings, ``poise/diagnostics/host.py``). Tables through rich;
  ``--json`` prints the same as data.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from poise import config as cfg
from poise.diagnostics import busbw, host, rules
from poise.diagnostics.report import VERDICT_STYLE, show_findings
from poise.diagnostics.run import load_run
from poise.launch import cluster_job
from poise.launch.job import launch_job
from poise.log import make_console

DIAGNOSTICS: dict[str, ModuleType] = {"busbw": busbw}


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("diagnose", help="measure the network, diagnose a finished run, check the host")
    kinds = parser.add_subparsers(dest="diagnostic", required=True, parser_class=type(parser))
    for name, module in DIAGNOSTICS.items():
        kind = kinds.add_parser(name, help=_escaped(module.HELP), description=_escaped(module.__doc__.splitlines()[0]))
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
    for name, (help_, add, run_local) in LOCAL.items():
        kind = kinds.add_parser(name, help=_escaped(help_), description=_escaped(help_))
        add(kind)
        kind.set_defaults(run=run_local)


def _escaped(text: str) -> str:
    """``text`` as argparse's %-formatted help takes it literally."""
    return text.replace("%", "%%")


def prepare(args: argparse.Namespace) -> cfg.RunConfig:
    """Check a measurement's arguments and resolve the job's config, before anything starts
    (one-line ValueError for anything wrong)."""
    module: ModuleType = args.module
    module.check_arguments(args)
    # absolute, so every worker (and node) writes to the same place
    args.out = str(Path(args.out or module.default_out_dir()).resolve())
    return cfg.from_dict({"out_dir": args.out, "dist": _dist_settings(args), "cluster": _cluster_settings(args)})


def run(args: argparse.Namespace) -> int:
    module: ModuleType = args.module
    config = prepare(args)
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
        if not (nodes.isascii() and nodes.isdigit()):
            raise ValueError(f"--cluster {args.cluster!r} is invalid: give N[:M], positive integers")
        settings["nodes"] = int(nodes)
    if getattr(args, "link", ""):
        settings["link"] = args.link
    return settings


# -- checks in this process --------------------------------------------------------------


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="a run's output directory (report.json and timeline.npz)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON instead of a table")
    parser.add_argument("--link", default="", help="the job's line rate (e.g. 1gbit) when the run does not record it")
    parser.add_argument("--rules", default="", help=f"only these rules, comma-separated: {', '.join(rules.RULES)}")


def _run_rules(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.rules.split(",") if n.strip()] or None
    run = load_run(args.dir, link=args.link)
    findings = rules.evaluate(run, names)
    if args.json:
        sys.stdout.write(json.dumps([f.to_dict() for f in findings], indent=2) + "\n")
        return 0
    console = make_console()
    show_findings(console, findings, f"poise diagnose run {args.dir}")
    _show_decisions(console, run.report)
    return 0


def _show_decisions(console: Any, report: dict[str, Any]) -> None:
    """What poise decided in the run, when and why (the report's ``decisions``; for a report
    written before they were recorded, rebuilt from its own keys by the same function)."""
    from poise.decide import decisions, describe

    found = report.get("decisions")
    items = found if isinstance(found, list) and all(isinstance(d, dict) for d in found) else \
        [d.as_dict() for d in decisions(report)]
    if items:
        console.print("what poise decided (and what pins it):", markup=False)
        for line in describe(items):
            console.print(f"  {line}", markup=False, highlight=False)


def _add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as JSON instead of a table")
    parser.add_argument("--nproc", type=int, default=2, help="workers per machine the job runs (threads check)")
    parser.add_argument("--ifname", default="", help="the job's network interface (default: GLOO_SOCKET_IFNAME, "
                        "else the default route's)")


def _run_host(args: argparse.Namespace) -> int:
    if args.ifname and (not re.fullmatch(r"[A-Za-z0-9._-]{1,15}", args.ifname) or args.ifname in (".", "..")):
        raise ValueError(f"--ifname={args.ifname[:40]!r} is invalid: give an interface name of 1-15 letters, digits, "
                         "'.', '_' or '-'")
    checks = host.check_host(nproc=args.nproc, ifname=args.ifname)
    if args.json:
        sys.stdout.write(json.dumps([c.to_dict() for c in checks], indent=2) + "\n")
        return 0
    from rich.table import Table

    table = Table(title="poise diagnose host (read-only: nothing is changed)")
    for header in ("", "setting", "current", "recommended", "command"):
        table.add_column(header)
    for c in checks:
        table.add_row(f"[{VERDICT_STYLE[c.verdict]}]{c.verdict}[/]", c.name, c.current, c.recommended, c.command)
    make_console().print(table)
    return 0


# name -> (help, add_arguments, run)
LOCAL: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "run": ("where a finished run's time went, and what to change: rules over its report.json and timeline.npz",
            _add_run_arguments, _run_rules),
    "host": ("read-only checks of this host's network and CPU settings, with the commands that set them",
             _add_host_arguments, _run_host),
}
