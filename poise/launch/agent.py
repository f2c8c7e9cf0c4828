"""One node's launcher, run inside that node's namespace by :mod:`poise.launch.cluster_job`.

``ip netns exec <ns> python -m poise.launch.agent --config FILE --dist JSON`` (or
``--module-args JSON`` instead of ``--config``, for ``poise diagnose``) starts torch's
elastic agent for this node exactly as ``poise train`` does on a real machine, with the node's
:class:`poise.config.DistConfig` (node rank, rendezvous endpoint, local address, interface)
given as JSON. The job's ``config.toml`` is the same file on every node.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from poise.config import DistConfig
from poise.launch.elastic import WORKER_MODULE, launch
from poise.log import setup_logging


def main(argv: list[str] | None = None) -> int:
    """Run this node's workers; returns 0, 1 (a worker failed) or 2 (bad arguments)."""
    parser = argparse.ArgumentParser(prog="poise.launch.agent")
    parser.add_argument("--config", default=None, help="the job's resolved config.toml")
    parser.add_argument("--module-args", default=None,
                        help="JSON list of the workers' arguments, instead of --config (poise diagnose)")
    parser.add_argument("--dist", required=True, help="this node's DistConfig as a JSON object")
    parser.add_argument("--module", default=WORKER_MODULE, help="the workers' module")
    parser.add_argument("--command", default="train", help="the poise command, for messages")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        dist = DistConfig(**json.loads(args.dist))
    except (ValueError, TypeError) as exc:
        sys.stderr.write(f"poise.launch.agent: error: {exc}\n")
        return 2
    module_args = json.loads(args.module_args) if args.module_args is not None else None
    config_path = Path(args.config) if args.config is not None else None
    return launch(dist, config_path, module=args.module, command=args.command, module_args=module_args)


if __name__ == "__main__":
    sys.exit(main())
