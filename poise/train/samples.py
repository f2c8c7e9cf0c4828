"""A record of which samples each rank trained on at each step (``diagnostics.record_samples``).

One JSON line per step in ``<out_dir>/samples/rank-<r>.jsonl``: ``{"step", "epoch", "indices"}``.
It is how tests check that a run resumed after a failure trains on the same samples, each
once per epoch, as an uninterrupted one. A resumed run first cuts every rank's file back to
the steps before its checkpoint (steps after it are trained again), so the files always
describe the run whose model you hold.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import IO

import numpy as np
import torch.distributed as dist

from poise.runtime.dist import DistContext


def keep_steps_before(path: Path, step: int) -> None:
    """Cut one rank's record back to its complete lines for steps before ``step``.

    The record is in step order (appended step after step, cut back at every resume), so only
    its tail is read, backward from the end, until a complete line of an earlier step: a resume
    costs the steps since the checkpoint, not the whole record (tens of MB after a long run with
    many restarts, which took seconds to parse and rewrite at every restart). A last line cut
    short by a killed process is dropped. One truncation: a crash leaves the record either cut
    or whole, and a whole one is cut again by the next resume."""
    with os.fdopen(_open_record(path, os.O_RDWR), "rb+") as handle:
        size = handle.seek(0, 2)
        keep = _end_of_steps_before(handle, size, step)
        if keep < size:
            handle.truncate(keep)


def record_problem(out_dir: Path) -> str:
    """Why the sample records in ``out_dir`` cannot be cut back and appended to ('' when they
    can): ``samples`` or a ``rank-*.jsonl`` in it that is a symbolic link or not a regular file.
    A resume truncates every record, and through a link it would truncate whatever the link
    points to."""
    directory = out_dir / "samples"
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        return f"{str(directory)!r} is {'a symbolic link' if directory.is_symlink() else 'not a directory'}"
    if not directory.is_dir():
        return ""
    for path in sorted(directory.glob("rank-*.jsonl")):
        if path.is_symlink() or not path.is_file():
            what = "a symbolic link" if path.is_symlink() else "not a regular file"
            return f"sample record {str(path)!r} is {what}: poise writes only regular files there"
    return ""


def _open_record(path: Path, flags: int) -> int:
    """Open a sample record (creating it with ``O_CREAT`` in ``flags``) without following a
    symbolic link, and only if it is a regular file (a FIFO would block, a device never end).

    Raises:
        ValueError: it is a link or not a regular file, in one line.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if path.is_symlink():
            raise ValueError(f"sample record {str(path)!r} is a symbolic link: poise writes only regular files "
                             "there") from None
        raise ValueError(f"sample record {str(path)!r} cannot be opened: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"sample record {str(path)!r} is not a regular file: poise writes only regular files there")
    return fd


def _end_of_steps_before(handle: IO[bytes], size: int, step: int) -> int:
    """The byte offset just past the last complete line of a step before ``step`` (0: none)."""
    block = 1 << 16
    while True:
        start = max(0, size - block)
        handle.seek(start)
        data = handle.read(size - start)
        first = 0 if start == 0 else data.find(b"\n") + 1  # where this block's first whole line starts
        if start > 0 and first == 0:  # no line ends in this block
            block *= 4
            continue
        pos = len(data) if data.endswith(b"\n") else data.rfind(b"\n") + 1  # a cut-short last line: dropped
        while pos > first:
            line_start = data.rfind(b"\n", max(first - 1, 0), pos - 1) + 1
            try:
                earlier = json.loads(data[line_start:pos])["step"] < step
            except (ValueError, KeyError, TypeError):
                earlier = False  # not a record line: dropped with the steps after the checkpoint
            if earlier:
                return start + pos
            pos = line_start
        if start == 0:
            return 0
        block *= 4  # the steps since the checkpoint did not fit: read further back


def read_samples(directory: Path) -> dict[int, list[int]]:
    """Epoch -> every sample index trained on in it, over all ranks' records in ``directory``."""
    out: dict[int, list[int]] = {}
    for path in sorted(directory.glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out.setdefault(entry["epoch"], []).extend(entry["indices"])
    return out


class SampleLog:
    """This rank's record file, open for appending."""

    def __init__(self, handle: IO[str]) -> None:
        self.handle = handle

    @classmethod
    def open(cls, out_dir: Path, ctx: DistContext, start_step: int) -> SampleLog:
        """Rank 0 cuts every record back to ``start_step`` (a collective: call on every rank)."""
        directory = out_dir / "samples"
        if ctx.is_main:
            problem = record_problem(out_dir)
            if problem:
                raise ValueError(problem)
            directory.mkdir(parents=True, exist_ok=True)
            for path in directory.glob("rank-*.jsonl"):
                keep_steps_before(path, start_step)
        dist.barrier()
        fd = _open_record(directory / f"rank-{ctx.rank:05d}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        return cls(os.fdopen(fd, "a"))

    def write(self, step: int, epoch: int, indices: np.ndarray) -> None:
        self.handle.write(json.dumps({"step": step, "epoch": epoch, "indices": [int(i) for i in indices]}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()
