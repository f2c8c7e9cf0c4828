"""What poise's timing adds to a training step: the same steps with and without a Session.

Why: the session times every step with clock marks and the probe's marks in each gradient
bucket's hook (CUDA events on a GPU, ``poise/runtime/clock.py``), reads them one step late,
records, and re-plans. The issue's target is at most 1 % of a step on a real model. This
measures it on the ``code-lm`` task's model (:class:`poise.tasks.code_lm.ByteTransformer`) in
a world of one process, three ways, on the same batches:

- ``ddp``: plain DDP (torch's own all-reduce in C++), ``loss.backward()``;
- ``ddp+hook``: DDP with poise's uncompressed comm hook (``poise.comm.hook("none")``), no probe;
- ``session``: ``poise.Session(..., comm="none")``: the same hook behind the probe, the step's
  marks, the record, the sampler.

``probe_overhead_pct`` is ``session`` against ``ddp+hook`` (what timing and recording add);
``session_vs_ddp_pct`` also counts poise's Python hook against torch's C++ one. The variants
run in interleaved rounds (each round: every variant's warm-up, then its timed steps) so that
clock drift and heating fall on all of them; the figure is the median over rounds of each
variant's mean step. The batches are random bytes of one fixed length: the step's compute,
not the data, is what the overhead is measured against. Timing synchronizes the device at
the start and end of each timed window only (a benchmark; the session's own hot path has no
synchronize).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import poise
import poise.comm
from poise.tasks.code_lm import VOCAB_SIZE, ByteTransformer

VARIANTS = ("ddp", "ddp+hook", "session")
TARGET_PCT = 1.0  # the bound on what timing adds to a step


@dataclass(frozen=True)
class ModelSize:
    """One code-lm model and batch: ``batch_size`` samples of ``seq_len`` bytes per step."""

    label: str
    d_model: int
    num_layers: int
    num_heads: int
    seq_len: int
    batch_size: int


# code-lm's default model (task config defaults) and one of a size a GPU is bought for
SIZES = {
    "default": ModelSize("default", d_model=128, num_layers=2, num_heads=4, seq_len=1024, batch_size=8),
    "gpu": ModelSize("gpu", d_model=768, num_layers=12, num_heads=12, seq_len=1024, batch_size=16),
    "tiny": ModelSize("tiny", d_model=32, num_layers=1, num_heads=2, seq_len=32, batch_size=4),  # dry runs
}


class _Indices(Dataset[int]):
    """Sample i is the number i: batches are index tensors into the device-resident tokens."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        return i


def _seconds(device: torch.device, run: Callable[[], None]) -> float:
    """Wall seconds of ``run``, the device drained before and after (CPU/GPU sync points: a
    benchmark's window, never the training hot path)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _batches(loader: DataLoader, sampler: Any) -> Iterator[torch.Tensor]:
    """The loader's batches, epoch after epoch, forever."""
    epoch = 0
    while True:
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


class _Variant:
    """One way of running the step on its own copy of the model (see module doc)."""

    def __init__(self, name: str, model: nn.Module, tokens: torch.Tensor, size: ModelSize, device: torch.device):
        self.name, self.tokens, self.device = name, tokens, device
        pin = device.type == "cuda"
        self.session: poise.Session | None = None
        self.hook: Any = None
        if name == "session":
            data = poise.Data(lengths=np.full(len(tokens), size.seq_len), batch_size=size.batch_size)
            self.session = poise.Session(model, data, balance="static", comm="none")
            self.model: nn.Module = self.session.model
            loader = self.session.dataloader(_Indices(len(tokens)), pin_memory=pin)
            self.batches = _batches(loader, self.session.sampler)
        else:
            ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=ids)
            if name == "ddp+hook":
                self.hook = poise.comm.hook("none")
                self.model.register_comm_hook(None, self.hook)
            loader = DataLoader(_Indices(len(tokens)), batch_size=size.batch_size, shuffle=True, pin_memory=pin,
                                generator=torch.Generator().manual_seed(0))
            self.batches = _batches(loader, None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def _loss(self, index: torch.Tensor) -> torch.Tensor:
        batch = self.tokens.index_select(0, index.to(self.device, non_blocking=True))
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))

    def step(self) -> None:
        index = next(self.batches)
        if self.session is not None:
            with self.session.step() as step:
                step.backward(self._loss(index))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            return
        if self.hook is not None:
            self.hook.state.reset_step()
        self._loss(index).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def measure(size: ModelSize, device: torch.device, *, steps: int, warmup: int, rounds: int,
            say: Callable[[str], None]) -> dict[str, Any]:
    """Median step seconds of each variant on ``size`` and the overheads (see module doc).

    Needs an initialized process group of one rank (the session's rules). Returns a dict with
    ``step_ms`` per variant, ``probe_overhead_pct``, ``session_vs_ddp_pct``, ``hook_vs_ddp_pct``,
    ``meets_target`` and the session's own report figures.
    """
    torch.manual_seed(0)
    base = ByteTransformer(max_seq_len=size.seq_len, d_model=size.d_model, num_layers=size.num_layers,
                           num_heads=size.num_heads).to(device)
    count = size.batch_size * 64
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB_SIZE, (count, size.seq_len + 1), generator=generator).to(device)
    variants = [_Variant(name, copy.deepcopy(base), tokens, size, device) for name in VARIANTS]
    per_round: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            v.run(warmup)
            per_round[v.name].append(_seconds(device, lambda v=v: v.run(steps)) / steps)
        say(f"  {size.label}: round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {1e3 * s[-1]:.2f} ms" for n, s in per_round.items()))
    step_s = {name: statistics.median(values) for name, values in per_round.items()}
    session = variants[-1].session
    assert session is not None
    report = session.finish() or {}

    def pct(a: str, b: str) -> float:
        return 100.0 * (step_s[a] - step_s[b]) / step_s[b]

    overhead = pct("session", "ddp+hook")
    return {
        "model": asdict(size),
        "params": sum(p.numel() for p in base.parameters()),
        "steps_per_round": steps, "warmup_steps": warmup, "rounds": rounds,
        "step_ms": {name: 1e3 * s for name, s in step_s.items()},
        "step_ms_per_round": {name: [1e3 * s for s in values] for name, values in per_round.items()},
        "probe_overhead_pct": overhead,
        "session_vs_ddp_pct": pct("session", "ddp"),
        "hook_vs_ddp_pct": pct("ddp+hook", "ddp"),
        "probe_overhead_ms": 1e3 * (step_s["session"] - step_s["ddp+hook"]),
        "target_pct": TARGET_PCT,
        "meets_target": overhead <= TARGET_PCT,
        "session_clock": type(session.clock).__name__,
        "session_report": {k: report.get(k) for k in ("steps", "backend", "median_step_s", "median_compute_s",
                                                       "comm_fraction") if k in report},
    }


__all__ = ["SIZES", "TARGET_PCT", "VARIANTS", "ModelSize", "measure"]
