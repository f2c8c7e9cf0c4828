"""``poise``: the command line. Parses, dispatches, and turns user errors into one line + exit 2."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from poise.log import setup_logging

log = logging.getLogger("poise.cli")

USAGE_ERROR = 2
# Every command, in --help's order: the module poise.cli.NAME adds its parser and runs it. Only
# the command given is imported (the others' modules import the benches, the diagnostics, FSDP:
# seconds before a job starts); --help, an unknown command and the reference build them all.
COMMANDS = ("demo", "train", "pipeline", "bench", "diagnose", "cluster", "checkpoint", "plan")


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # one line even when argparse repeats a value that holds a line break
        one_line = message.replace("\n", "\\n").replace("\r", "\\r")
        sys.stderr.write(f"{self.prog}: error: {one_line}\n")
        sys.exit(USAGE_ERROR)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``poise`` parser with every command's, or with ``only`` that command's (the one given:
    its module alone is imported; the parsing of its arguments is the same)."""
    parser = OneLineParser(prog="poise", description="Balanced, communication-efficient distributed training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMANDS:
        if only is None or name == only:
            importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``poise`` command line; returns the process exit code."""
    setup_logging()
    given = sys.argv[1:] if argv is None else argv
    # the command is the first argument (``poise`` itself takes no option but --help)
    args = build_parser(given[0] if given and given[0] in COMMANDS else None).parse_args(given)
    try:
        return int(args.run(args))
    except ValueError as exc:
        # User input the config or a command rejected: one line, no traceback.
        sys.stderr.write(f"poise {args.command}: error: {exc}\n")
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
    finally:
        _remove_stale_groups()


def _remove_stale_groups() -> None:
    """Killed workers leave their emulated slowdown cgroups (--rank-speed) behind: remove them.

    Only after a command that imported torch: starting workers needs torch.distributed's
    launcher, so a command that never loaded torch (a refused flag or config) started none, and
    the emulation's module imports torch (about 2 s). A later job removes what is left."""
    if "torch" not in sys.modules:
        return
    from poise.emulate.speed import remove_stale_groups

    for group in remove_stale_groups():
        log.info("removed the cgroup %s of a worker that is gone", group)
