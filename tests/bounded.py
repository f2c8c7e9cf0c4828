"""Run one input case in a forked child with a memory and a time limit, and say how it ended.

Fuzz and attack tests feed poise inputs that may, before a fix, grow without bound (a planner
asked about 10^9 nodes) or never return (``--params inf``). Each such case runs here, in a
child forked from the test process (cheap: nothing is imported again), which before it starts

- limits its address space (``RLIMIT_AS``) to what it already maps plus ``memory_bytes``, so
  that a runaway allocation ends in ``MemoryError`` in the child, never in the machine's OOM
  killer;
- arms a ``SIGALRM`` after ``timeout_s``; a child that does not exit by the deadline (stuck in
  C code where the alarm cannot interrupt it) is killed by the parent.

The child sends back how the call ended: ``ok`` (and its value, when picklable), ``refused``
(a ``ValueError``: its type and message), ``error`` (any other exception, with its traceback)
or ``exit`` (``SystemExit`` code), with what it wrote on stdout and stderr. The parent reports
``hung`` for a child it had to kill.
Only what the case function does runs in the child: keep it free of threads and torch ops
(fork keeps only the calling thread).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEMORY_BYTES = 1 << 30
TIMEOUT_S = 20.0


class CaseTimeout(Exception):
    """Raised in the child by its alarm: the case ran past its time limit."""


@dataclass(frozen=True)
class Outcome:
    """How one case ended.

    Attributes:
        kind: ``ok``, ``refused`` (a ValueError escaped), ``error`` (another exception),
            ``exit`` (SystemExit), ``hung`` (past the time limit: the alarm, or killed by the
            parent), ``died`` (the child ended without a report, e.g. a signal).
        value: the return value (ok), the exception type name (refused, error) or the exit
            code (exit).
        message: the exception's message (error); the traceback is in ``trace``.
        out, err: what the case wrote to stdout and stderr.
    """

    kind: str
    value: Any = None
    message: str = ""
    trace: str = ""
    out: str = ""
    err: str = ""

    def describe(self) -> str:
        """One paragraph for a failing assertion."""
        return (f"{self.kind} {self.value!r}: {self.message[:400]}\n{self.trace[-1500:]}\nstdout: {self.out[-500:]}"
                f"\nstderr: {self.err[-1500:]}")


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout("the case ran past its time limit")


def _child(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], write_fd: int,
           out_fd: int, err_fd: int, memory_bytes: int, timeout_s: float) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    limit = _mapped_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    report: tuple[Any, ...]
    try:
        value = fn(*args, **kwargs)
        try:
            pickle.dumps(value)
        except Exception:
            value = repr(value)[:200]
        report = ("ok", value, "", "")
    except SystemExit as exc:
        report = ("exit", exc.code, "", "")
    except CaseTimeout as exc:
        report = ("hung", "CaseTimeout", str(exc), traceback.format_exc())
    except ValueError as exc:  # poise's refusals of bad input (and their subclasses)
        report = ("refused", type(exc).__name__, str(exc), traceback.format_exc())
    except BaseException as exc:  # the point: anything that escapes is reported, not raised
        report = ("error", type(exc).__name__, str(exc), traceback.format_exc())
    signal.setitimer(signal.ITIMER_REAL, 0)
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    data = pickle.dumps(report)
    with os.fdopen(write_fd, "wb") as handle:
        handle.write(data)
    os._exit(0)


def run_bounded(fn: Callable[..., Any], *args: Any, memory_bytes: int = MEMORY_BYTES, timeout_s: float = TIMEOUT_S,
                **kwargs: Any) -> Outcome:
    """``fn(*args, **kwargs)`` in a forked child within ``memory_bytes`` more address space and
    ``timeout_s`` seconds; see the module docstring."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            try:
                os.close(read_fd)
                _child(fn, args, kwargs, write_fd, out.fileno(), err.fileno(), memory_bytes, timeout_s)
            finally:
                os._exit(3)
        os.close(write_fd)
        chunks = []
        deadline = time.monotonic() + timeout_s + 10.0  # the alarm comes first; this is for C code
        hung = False
        with os.fdopen(read_fd, "rb") as reader:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    hung = True
                    break
                ready, _, _ = select.select([reader], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(reader.fileno(), 1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
        if hung:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        texts = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if hung:
        return Outcome("hung", None, f"killed after {timeout_s + 10:g} s", "", *texts)
    if not chunks:
        return Outcome("died", os.waitstatus_to_exitcode(status), "no report from the child", "", *texts)
    kind, value, message, trace = pickle.loads(b"".join(chunks))
    return Outcome(kind, value, message, trace, *texts)


def one_line(text: str) -> bool:
    """Whether ``text`` is exactly one non-empty line (a trailing newline allowed)."""
    lines = text.strip("\n").split("\n")
    return len(lines) == 1 and bool(lines[0].strip())


def refused_in_one_line(outcome: Outcome, prefix: str = "") -> bool:
    """Whether ``outcome`` is a one-line refusal: a ValueError of one line, or exit code 2 with
    one line on stderr (starting with ``prefix``) and no traceback."""
    if outcome.kind == "refused":
        return one_line(outcome.message)
    if outcome.kind in ("exit", "ok") and outcome.value == 2:
        return one_line(outcome.err) and outcome.err.startswith(prefix) and "Traceback" not in outcome.err
    return False
