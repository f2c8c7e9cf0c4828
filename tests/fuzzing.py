"""What the fuzz tests of issue 46 share: the Hypothesis settings, the values drawn for
arguments, the acceptance check, and a finished run's directory to read back.

The property is the project's rule for bad input: **it works, or it is refused in one line** (a
``ValueError`` of one line, or exit code 2 with one line on stderr), never a traceback, and
always within bounded time and memory: each case runs in a forked child with 1 GiB more
address space and a time limit (tests/bounded.py), so a case that runs away fails there
instead of taking the machine. Seeded (``derandomize``) and small (``max_examples``).
Used by tests/unit/test_fuzz_cli.py (arguments) and tests/unit/test_fuzz_files.py (files).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from poise.cli import build_parser, main
from poise.diagnostics.timeline import FIELDS, save_table
from tests.bounded import Outcome, refused_in_one_line

# What the cases reach, imported here once: a forked case would import it again, each time (the
# pipeline's checks pull in torch's pipelining and compiler modules: about 0.3 s of CPU a case)
WARM = ("poise.cli.flags", "poise.comm.registry", "poise.pipeline.worker", "poise.train.recipe",
        "poise.diagnostics.rules", "poise.plan.planner", "poise.plan.model", "poise.checkpoint.sharded",
        "poise.checkpoint.contents", "poise.emulate.speed")
for _name in WARM:
    importlib.import_module(_name)
build_parser()  # every command's module

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIMEOUT_S = 20.0

SPECIAL = ["nan", "inf", "-inf", "-1", "0", "1", "2", "0.5", "1e300", "-1e300", "1e-300", "99999999999999999999999",
           "", " ", "abc", "1:2", "1:0.5@3", "%s", "%(prog)s", "20%", "{}", "[]", "true", "false", "none", "0x10",
           "1_000", "127.0.0.1", "::1", "slow:rank=1,x=0.2", "bernoulli:p=2,x=1", "1gbit", "5us", "/", "/dev/null",
           "/dev/zero", "..", "-", "--", "a,b", ",", "1,2,3", "9" * 5000, "é", "\t"]
# numbers at and beyond every edge, drawn more often than the rest: most bad input is one of them
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e300", "1e-300", "99999999999999999999999", "1e15", "4294967296"]
VALUES = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(SPECIAL), st.integers(-(2**70), 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   # no line breaks: argparse's "unrecognized arguments: <value>" prints them as they are, and
                   # poise/cli/__init__.py (OneLineParser.error) does not escape them yet
                   st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00\n\r\x0b\x0c\x1c\x1d\x1e"
                                         "\x85\u2028\u2029"), max_size=16))


def options_of(parser: Any) -> list[str]:
    """Every long option of ``parser`` except --help."""
    return sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"})


def subparser(*path: str) -> Any:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)
                      and name in a.choices)
        parser = action.choices[name]
    return parser


def draw_argv(data: st.DataObject, options: list[str], most: int = 4) -> list[str]:
    """1 to ``most`` options with drawn values, as ``--flag value`` or ``--flag=value``."""
    argv: list[str] = []
    pool = [*options, "--no-such-flag"]  # unknown flags too (and a command without options has one)
    for flag in data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=most), label="flags"):
        value = data.draw(VALUES, label=flag)
        argv += [f"{flag}={value}"] if data.draw(st.booleans(), label="joined") else [flag, value]
    return argv


def acceptable(outcome: Outcome, prefix: str = "") -> bool:
    """Works (returns anything but the exit codes 1 and 2, or exits 0), or is refused in one line."""
    if outcome.kind == "ok" and outcome.value not in (1, 2):
        return True
    if outcome.kind == "exit" and outcome.value in (0, None):
        return True
    return refused_in_one_line(outcome, prefix)


def check(outcome: Outcome, argv: Any) -> None:
    # "poise: error: unrecognized arguments" comes from the top parser, "poise train: error:" from
    # the command's: either is one line on stderr
    assert acceptable(outcome, "poise"), f"{argv!r}:\n{outcome.describe()}"


# -- command-line arguments ----------------------------------------------------------------------



def plan_into(argv: list[str], out: str) -> int:
    return main(["plan", *argv, "--out", out])


def run_dir(out: Path, report: dict[str, Any] | None = None, table: np.ndarray | None = None) -> str:
    """A finished run's directory: a report.json and a timeline.npz of 2 ranks x 8 steps."""
    if table is None:
        table = np.abs(np.random.default_rng(0).normal(0.01, 0.005, (2, 8, len(FIELDS))))
        table[:, :, FIELDS.index("skipped")] = 0
    save_table(table, out / "timeline.npz")
    (out / "report.json").write_text(json.dumps(report if report is not None else REPORT))
    return str(out)


REPORT = {"world_size": 2, "steps": 8, "task": "digits", "codec": "none", "backend": "gloo", "balance": 0.9,
           "balance_strategy": "dynamic", "replans": [{"step": 4, "shares": [0.5, 0.5]}, {"step": 6,
                                                                                          "shares": [0.6, 0.4]}],
           "checkpoints": {"saves": [{"step": 4, "stall_s": 0.01}]},
           "config": {"cluster": {"nodes": 2, "link": "1gbit"}, "balance": {"max_share_change": 0.2}}}


