"""What every benchmark family shares: running real training jobs, tables, JSON output.

A family module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; the
``poise bench`` command lists them in one dict (``poise/cli/bench.py``).
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from poise.files import write_json_atomic
from poise.launch.command import PoiseProcess
from poise.launch.command import start as start_command
from poise.launch.processes import end_tree
from poise.log import make_console

log = logging.getLogger(__name__)

Column = tuple[str, str, Callable[[Any], str]]  # (row key, header, formatter)


def output_dir(requested: str, family: str) -> Path:
    """``requested`` or ``runs/bench-<family>-<timestamp>``, created."""
    out = Path(requested or Path("runs") / time.strftime(f"bench-{family}-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def run_train_job(
    name: str, out_dir: Path, train_args: Sequence[str], timeout_s: float, *, command: str = "train",
    cpus: set[int] | None = None,
) -> dict[str, Any]:
    """Run ``poise train`` (or another job ``command``, e.g. ``pipeline``: the real CLI and
    launcher) in a process of its own (:func:`poise.launch.command.start`); return its report.

    ``cpus``: the CPUs the job and every process it starts may run on (its affinity; None: as
    this process). Output goes to ``out_dir/name/<command>.log``; a failed job raises
    RuntimeError naming it. A ``train`` job that names no ``--balance`` runs static sharding
    (plain DDP's split): the benches compare codecs, collectives and synchronizations on
    DDP's own batches, whatever ``poise train``'s default (``auto``) would decide.
    """
    out = out_dir / name
    out.mkdir(parents=True, exist_ok=True)
    if command == "train" and "--balance" not in train_args:
        train_args = [*train_args, "--balance", "static"]
    flags = [command, *train_args, "--out", str(out), "--diagnostics.progress", "false", "--diagnostics.plot", "false"]
    log.info("bench job %s: poise %s %s", name, command, " ".join(train_args))
    log_path = out / f"{command}.log"
    code = wait_bounded(start_command(flags, log_path, cpus=cpus), timeout_s)
    if code is None:
        raise RuntimeError(f"bench job {name} ran past its limit of {timeout_s:g} s and was ended (see {log_path})")
    if code != 0:
        tail = (log_path.read_text().strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"bench job {name} failed (exit {code}, see {log_path}): {tail}")
    return json.loads((out / "report.json").read_text())


def wait_bounded(proc: PoiseProcess, timeout_s: float) -> int | None:
    """``proc``'s exit code, or None when it ran past ``timeout_s`` seconds: then it and every
    process below it (the launcher's workers, which live in sessions of their own) are ended
    (:func:`poise.launch.processes.end_tree`), as they are when this process is interrupted."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        end_tree(proc)
        return None
    except BaseException:
        end_tree(proc)
        raise


def show_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> None:
    """Print ``rows`` as a rich table with the given columns (in a file, up to 300 characters
    wide: a bench's table is read whole, not wrapped cell by cell)."""
    from rich.table import Table

    table = Table(title=title)
    for _, header, _ in columns:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(fmt(row[key]) if key in row else "-" for key, _, fmt in columns))
    make_console(width=300).print(table)


def save_results(out_dir: Path, family: str, data: dict[str, Any]) -> Path:
    """Write ``<out_dir>/<family>.json`` atomically and say where."""
    path = write_json_atomic(out_dir / f"{family}.json", {"bench": family, **data})
    make_console().print(f"wrote {path}")
    return path


def positive_ints(text: str, flag: str) -> list[int]:
    """Parse ``"1,2,4"``; raise a one-line ValueError naming ``flag`` otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag}={text!r} is invalid: give positive integers separated by commas")
    return values


def require_positive(args: Any, *names: str) -> None:
    """One-line ValueError for the first of ``args.<name>`` that is not > 0."""
    for name in names:
        value = getattr(args, name)
        if not (value > 0 and math.isfinite(value)):  # inf seconds or steps would never end
            raise ValueError(f"--{name.replace('_', '-')}={value} must be positive and finite")
