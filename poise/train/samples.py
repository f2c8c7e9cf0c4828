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

from poise.files import write_text_atomic
from poise.runtime.dist import DistContext


def keep_steps_before(path: Path, step: int) -> None:
    """Rewrite one rank's record with only its complete lines for steps before ``step``."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a killed process
            continue
        if entry["step"] < step:
            kept.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


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
