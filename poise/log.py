"""Logging set-up and the rank-0 progress bar.

Every module logs through ``logging.getLogger(__name__)``; this module decides where that
goes. Workers tag each line with their rank and only rank 0 logs below WARNING, so a
two-worker job reads like one program. Progress is drawn with rich on rank 0 only.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported where it draws: a worker that draws nothing never loads it
    from rich.console import Console
    from rich.progress import Progress

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when it writes: a handler
    bound to the stream of its set-up would write to a closed one once that stream was
    replaced (a test's capture, a redirected stream) and print "--- Logging error ---"."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """The stream is always the current ``sys.stderr``: nothing to set."""


def setup_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Route the ``poise`` loggers to stderr, tagged with the rank when there is one.

    Ranks other than 0 log warnings and errors only: their progress would repeat rank 0's.
    """
    tag = "" if rank is None else f"[rank {rank}] "
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(tag + _FORMAT, datefmt="%H:%M:%S"))
    logger = logging.getLogger("poise")
    logger.handlers[:] = [handler]
    logger.setLevel(level if rank in (None, 0) else max(level, logging.WARNING))
    logger.propagate = False


class StepProgress:
    """A live bar over training steps, or nothing when disabled (other ranks, no terminal)."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self._progress = progress
        self._task = progress.add_task("train", total=total, status="") if progress else None

    def update(self, step: int, status: str) -> None:
        """Mark ``step`` (0-based) done and show ``status`` (e.g. loss and samples/s)."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step + 1, status=status)


def make_console(stderr: bool = False, width: int = 200) -> Console:
    """A rich console; when output is not a terminal (a file, CI), tables get ``width`` columns
    instead of rich's default 80, so they are not cut."""
    from rich.console import Console

    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=width)


@contextmanager
def step_progress(enabled: bool, total: int) -> Iterator[StepProgress]:
    """Context manager yielding a :class:`StepProgress`; draws only when ``enabled`` on a TTY."""
    if not enabled:
        yield StepProgress(None, total)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield StepProgress(None, total)
        return
    columns = (
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        yield StepProgress(progress, total)
