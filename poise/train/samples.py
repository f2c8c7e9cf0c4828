"""A record of which samples each rank trained on at each step (``diagnostics.record_samples``).

One JSON line per step in ``<out_dir>/samples/rank-<r>.jsonl``: ``{"step", "epoch", "indices"}``.
It is how tests check that a run resumed after a failure trains on the same samples, each
once per epoch, as an uninterrupted one. A resumed run first cuts every rank's file back to
the steps before its checkpoint (steps after it are trained again), so the files always
describe the run whose model you hold.
"""

from __future__ import annotations

import json
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
    with open(path, "rb+") as handle:
        size = handle.seek(0, 2)
        keep = _end_of_steps_before(handle, size, step)
        if keep < size:
            handle.truncate(keep)


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
            directory.mkdir(parents=True, exist_ok=True)
            for path in directory.glob("rank-*.jsonl"):
                keep_steps_before(path, start_step)
        dist.barrier()
        return cls(open(directory / f"rank-{ctx.rank:05d}.jsonl", "a"))

    def write(self, step: int, epoch: int, indices: np.ndarray) -> None:
        self.handle.write(json.dumps({"step": step, "epoch": epoch, "indices": [int(i) for i in indices]}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()
