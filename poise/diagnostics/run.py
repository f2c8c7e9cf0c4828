"""What a finished run wrote, read back and checked: the input of ``poise diagnose run``.

Any run through :class:`poise.Session` (``poise train`` and users' own scripts alike) leaves
``report.json`` and ``timeline.npz`` in its ``out_dir``. Files on disk are input: a missing,
truncated or mismatched file stops with one line naming it, never a traceback deep in a rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

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
        report = json.loads(report_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{report_path}: no such file (not a poise run's output directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{report_path}: not readable JSON ({exc})") from None
    if not isinstance(report, dict):
        raise ValueError(f"{report_path}: expected a JSON object, got {type(report).__name__}")
    table = load_table(out / "timeline.npz")
    ranks, steps = table.shape[:2]
    if report.get("world_size", ranks) != ranks or report.get("steps", steps) != steps:
        raise ValueError(f"{out}: report.json has {report.get('world_size')} ranks x {report.get('steps')} steps but "
                         f"timeline.npz {ranks} x {steps}: files of different runs")
    return RunData(table=table, report=report, link_bit_per_s=_link_bit_per_s(report, link))


def _link_bit_per_s(report: dict[str, Any], link: str) -> float | None:
    if link:
        return parse_rate_bit_per_s(link, what="--link")
    cluster = (report.get("config") or {}).get("cluster") or {}
    if isinstance(cluster, dict) and (cluster.get("nodes") or cluster.get("name")) and cluster.get("link"):
        return parse_rate_bit_per_s(str(cluster["link"]), what="cluster.link")
    return None


__all__ = ["RunData", "load_run"]
