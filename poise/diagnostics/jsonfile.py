"""Reading a JSON file that a run or a benchmark left (report.json, busbw.json, codecs.json),
bounded: files on disk are input, so their size and nesting are checked before anything uses
them, and every way a file can be unusable ends in one line naming it.

What is bounded and why: a file is read only if it is a regular file (a FIFO would block the
reader forever, ``/dev/zero`` would never end), up to :data:`MAX_JSON_BYTES` (what poise
writes is a few MB at most); JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused (the
parser would otherwise end in ``RecursionError``, which is no ``ValueError``).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 64 << 20
MAX_JSON_DEPTH = 32


class JsonFileError(ValueError):
    """A JSON file that cannot be used: missing, not a regular file, too large, too deep, not
    JSON, or not of the shape asked for. The message is one line naming the file."""


def read_bytes_bounded(path: str | Path, max_bytes: int) -> bytes:
    """The content of the regular file ``path``, at most ``max_bytes`` bytes.

    Opened without blocking (a FIFO is refused, not waited on) and checked to be a regular
    file before reading.

    Raises:
        FileNotFoundError: there is no such file (callers word that their own way).
        JsonFileError: not a regular file, unreadable, or larger than ``max_bytes``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise JsonFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise JsonFileError(f"{path}: {kind} (give a file)")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(max_bytes + 1)
        except OSError as exc:
            raise JsonFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise JsonFileError(f"{path}: larger than {max_bytes} bytes: not a file poise wrote")
    return data


def depth(value: Any, limit: int) -> int:
    """How deep ``value``'s lists and dicts nest (a scalar: 0), counted up to ``limit + 1``
    (iterative, so that a deep value cannot exhaust the stack)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a measurement can have")


def read_json(path: str | Path, *, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH,
              allow_nan: bool = True) -> Any:
    """Parse the JSON file ``path`` within the bounds of the module docstring.

    ``allow_nan``: whether ``NaN`` and ``Infinity`` may appear (poise writes ``NaN`` for
    figures it could not measure; files whose numbers feed a computation pass False).

    Raises:
        FileNotFoundError: there is no such file.
        JsonFileError: one line naming the file and what is wrong with it.
    """
    data = read_bytes_bounded(path, max_bytes)
    try:
        value = json.loads(data, **({} if allow_nan else {"parse_constant": _refuse_constant}))
    except RecursionError:
        raise JsonFileError(f"{path}: nested deeper than {max_depth} levels: not a file poise wrote") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise JsonFileError(f"{path}: not readable JSON ({str(exc)[:200]})") from None
    if depth(value, max_depth) > max_depth:
        raise JsonFileError(f"{path}: nested deeper than {max_depth} levels: not a file poise wrote")
    return value


def read_json_object(path: str | Path, **bounds: Any) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object.

    Raises:
        FileNotFoundError: there is no such file.
        JsonFileError: as :func:`read_json`, or the file holds another JSON value.
    """
    value = read_json(path, **bounds)
    if not isinstance(value, dict):
        raise JsonFileError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "JsonFileError", "depth", "read_bytes_bounded", "read_json",
           "read_json_object"]
