"""What a finished run wrote, read back and checked: the input of ``poise diagnose run``.

Any run through :class:`poise.Session` (``poise train`` and users' own scripts alike) leaves
``report.json`` and ``timeline.npz`` in its ``out_dir``. Files on disk are input: a missing,
truncated or mismatched file stops with one line naming it, never a traceback deep in a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from poise.diagnostics.jsonfile import read_json_object
from poise.diagnostics.report import WARMUP_STEPS
from poise.diagnostics.timeline import load_table
from poise.units import parse_rate_bit_per_s


@dataclass(frozen=True)
class RunData:
    """One run's figures, as the rules see them.

    Attributes:
        table: ``[ranks, steps, len(FIELDS)]``, every rank's :class:`StepRecord` per step.
        report: ``report.json`` as a dict.
        link_bit_per_s: the line rate of the job's links, bits per second, when known (the
            emulated cluster's ``--link``, or ``poise diagnose run --link``); None otherwise.
    """

    table: np.ndarray
    report: dict[str, Any] = field(default_factory=dict)
    link_bit_per_s: float | None = None

    @property
    def steady(self) -> np.ndarray:
        """The table without its warm-up steps (DDP's bucket rebuild), as report.json's figures."""
        return self.table[:, WARMUP_STEPS:] if self.table.shape[1] > WARMUP_STEPS else self.table

    @property
    def world_size(self) -> int:
        return int(self.table.shape[0])

    @property
    def balance_strategy(self) -> str:
        return str(self.report.get("balance_strategy", "static"))

    def setting(self, section: str, name: str, default: Any = None) -> Any:
        """A setting of the run's recorded config (``poise train``), or ``default`` (users' scripts)."""
        config = self.report.get("config")
        if isinstance(config, dict) and isinstance(config.get(section), dict):
            return config[section].get(name, default)
        return default


def load_run(directory: str | Path, link: str = "") -> RunData:
    """Read ``report.json`` and ``timeline.npz`` from ``directory`` and check they agree.

    ``link``: the job's line rate (``1gbit``) when the report does not record one.

    Raises:
        ValueError: one line naming the file and what is wrong (missing, unreadable, a
            report and a timeline of different runs).
    """
    out = Path(directory)
    if not out.is_dir():
        raise ValueError(f"{out}: not a directory (give the out_dir of a run)")
    report_path = out / "report.json"
    try:
        report = read_json_object(report_path)
    except FileNotFoundError:
        raise ValueError(f"{report_path}: no such file (not a poise run's output directory?)") from None
    check_report(report, report_path)
    table = load_table(out / "timeline.npz")
    ranks, steps = table.shape[:2]
    if report.get("world_size", ranks) != ranks or report.get("steps", steps) != steps:
        raise ValueError(f"{out}: report.json has {report.get('world_size')} ranks x {report.get('steps')} steps but "
                         f"timeline.npz {ranks} x {steps}: files of different runs")
    return RunData(table=table, report=report, link_bit_per_s=_link_bit_per_s(report, link))


def _link_bit_per_s(report: dict[str, Any], link: str) -> float | None:
    if link:
        return parse_rate_bit_per_s(link, what="--link")
    cluster = _section(report, "cluster")
    if (cluster.get("nodes") or cluster.get("name")) and cluster.get("link"):
        return parse_rate_bit_per_s(str(cluster["link"]), what="cluster.link")
    return None


def _section(report: dict[str, Any], name: str) -> dict[str, Any]:
    """``report["config"][name]`` when both are tables (what check_report allows), else {}."""
    config = report.get("config")
    section = config.get(name) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


def _lookup(report: dict[str, Any], key: str) -> Any:
    """``report[a][b]`` for the dotted ``key`` ``a.b``; None where a level is missing or no table."""
    value: Any = report
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_report(report: dict[str, Any], path: str | Path) -> None:
    """Refuse a report whose figures the rules read have the wrong type (one line naming the
    key): the rules index and format them, and a report edited or written by something else
    must not end in a traceback there. Keys that are absent are fine (users' own scripts
    record less)."""
    def bad(key: str, expected: str) -> ValueError:
        return ValueError(f"{path}: {key} is {str(_lookup(report, key))[:60]!r}, expected {expected}")

    for key in ("world_size", "steps"):
        if key in report and (not isinstance(report[key], int) or isinstance(report[key], bool)):
            raise bad(key, "a whole number")
    if "balance" in report and not _number(report["balance"]):
        raise bad("balance", "a number")
    for key in ("codec", "backend", "balance_strategy"):
        if key in report and not isinstance(report[key], str):
            raise bad(key, "a string")
    for key in ("config", "checkpoints"):
        if report.get(key) is not None and not isinstance(report[key], dict):
            raise bad(key, "a JSON object")
    for name in ("cluster", "balance"):
        if _lookup(report, f"config.{name}") is not None and not isinstance(_lookup(report, f"config.{name}"), dict):
            raise bad(f"config.{name}", "a JSON object")
    link = _section(report, "cluster").get("link")
    if link is not None and not isinstance(link, str):
        raise bad("config.cluster.link", "a rate such as 1gbit")
    saves = _lookup(report, "checkpoints.saves")
    if saves is not None and not (isinstance(saves, list) and all(
            isinstance(s, dict) and _number(s.get("stall_s", 0.0)) for s in saves)):
        raise bad("checkpoints.saves", "a list of objects with a number stall_s")
    replans = report.get("replans")
    if replans is not None and not isinstance(replans, list):
        raise bad("replans", "a list")
    lengths = set()
    for entry in replans or []:
        shares = entry.get("shares") if isinstance(entry, dict) else None
        if shares is None:
            continue
        if not (isinstance(shares, list) and all(_number(v) and math.isfinite(v) for v in shares)):
            raise ValueError(f"{path}: replans holds shares {str(shares)[:60]!r}, expected a list of numbers")
        lengths.add(len(shares))
    if len(lengths) > 1:
        raise ValueError(f"{path}: replans holds shares of {len(lengths)} different lengths, expected one per rank")


__all__ = ["RunData", "check_report", "load_run"]
