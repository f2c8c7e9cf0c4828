"""``poise demo``: the README's first command (``make demo``); the runs live in :mod:`poise.bench.demo`."""

from __future__ import annotations

from typing import Any

from poise.bench import demo


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("demo", help=demo.HELP, description=demo.__doc__.splitlines()[0])
    demo.add_arguments(parser)
    parser.set_defaults(run=demo.run)
