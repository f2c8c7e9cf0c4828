"""``poise``: the command line. Parses, dispatches, and turns user errors into one line + exit 2."""

from __future__ import annotations

import argparse
import logging
import sys

from poise.cli import bench, checkpoint, cluster, demo, diagnose, pipeline, plan, train
from poise.emulate.speed import remove_stale_groups
from poise.log import setup_logging

log = logging.getLogger("poise.cli")

USAGE_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # one line even when argparse repeats a value that holds a line break
        one_line = message.replace("\n", "\\n").replace("\r", "\\r")
        sys.stderr.write(f"{self.prog}: error: {one_line}\n")
        sys.exit(USAGE_ERROR)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="poise", description="Balanced, communication-efficient distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo.add_parser(sub)
    train.add_parser(sub)
    pipeline.add_parser(sub)
    bench.add_parser(sub)
    diagnose.add_parser(sub)
    cluster.add_parser(sub)
    checkpoint.add_parser(sub)
    plan.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``poise`` command line; returns the process exit code."""
    setup_logging()
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as exc:
        # User input the config or a command rejected: one line, no traceback.
        sys.stderr.write(f"poise {args.command}: error: {exc}\n")
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        # killed workers leave their emulated slowdown cgroups (--rank-speed) behind
        for group in remove_stale_groups():
            log.info("removed the cgroup %s of a worker that is gone", group)
