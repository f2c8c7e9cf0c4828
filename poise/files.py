"""Writing files so that a crash never leaves half of one: temp file, fsync, rename.

Readers (other ranks, a later run, a user) see either the old file or the complete new
one. Every file poise writes goes through here.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], Any], *, make_parents: bool = True) -> Path:
    """Call ``write(handle)`` on a temp file beside ``path``, fsync it, then rename it over ``path``.

    The parent directory is created if needed (unless ``make_parents`` is False: then a
    missing one is a FileNotFoundError). On any error the temp file is removed and ``path``
    is left as it was.
    """
    target = Path(path)
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            # mkstemp creates 0600; outputs and caches may be read by other users' processes.
            os.fchmod(handle.fileno(), 0o644)
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def write_text_atomic(path: str | Path, text: str, *, make_parents: bool = True) -> Path:
    """Atomically write UTF-8 ``text`` to ``path``."""
    return write_atomic(path, lambda h: h.write(text.encode("utf-8")), make_parents=make_parents)


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2, *, make_parents: bool = True) -> Path:
    """Atomically write ``data`` as JSON to ``path``."""
    return write_text_atomic(path, json.dumps(data, indent=indent), make_parents=make_parents)
