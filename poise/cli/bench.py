"""``poise bench <family>``: run a benchmark, print a table, write JSON.

Speed claims live here, never in tests: each family measures the configurations it compares
side by side in one invocation and reports medians and ratios. Families are listed in one dict.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

from poise.bench import (
    auto,
    balance,
    checkpoint,
    codecs,
    diagnose,
    faults,
    network,
    outer,
    packed,
    parallel,
    partition,
    plan,
    scaling,
    soak,
    stragglers,
)

FAMILIES: dict[str, ModuleType] = {
    "scaling": scaling, "balance": balance, "codecs": codecs, "partition": partition, "network": network,
    "checkpoint": checkpoint, "diagnose": diagnose, "faults": faults, "plan": plan,
    "stragglers": stragglers, "outer": outer, "parallel": parallel, "auto": auto, "packed": packed,
}
# a family whose command runs more than its module's run(): faults with --minutes is the soak
RUNS = {"faults": soak.run_bench}


# reStructuredText roles and literals in a module doc: ``x`` and :func:`x` read as x in a terminal
_MARKUP = re.compile(r"(?::[a-z]+:)?`{1,2}([^`]+)`{1,2}")


def description(doc: str) -> str:
    """A family's ``--help`` description: its module doc's first paragraph, whole (its first line
    alone stopped mid-sentence), as plain text (no reStructuredText markup) on one line."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return _MARKUP.sub(lambda m: m.group(1).removeprefix("~"), " ".join(paragraph.split()))


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("bench", help="run a benchmark: prints a table and writes JSON")
    families = parser.add_subparsers(dest="family", required=True, parser_class=type(parser))
    for name, module in FAMILIES.items():
        # argparse %-formats help and descriptions ("20%" would format its own settings dict into them)
        family = families.add_parser(name, help=module.HELP.replace("%", "%%"),
                                     description=description(module.__doc__ or module.HELP).replace("%", "%%"))
        module.add_arguments(family)
        family.set_defaults(run=RUNS.get(name, module.run))
