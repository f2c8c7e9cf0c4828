"""Checkpoints of a model sharded with FSDP2 (``poise.checkpoint.sharded`` through
``checkpoint.capture``/``restore``) on real gloo ranks: rank 0 gets the full tensors under the
unsharded names; restored on the same number of ranks the next step is bit for bit the
uninterrupted one's; restored on another number of ranks every shard holds the saved values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from poise import checkpoint
from poise.checkpoint import sharded
from poise.config import CommConfig, ParallelConfig
from poise.train.optim import AdamW
from poise.train.recipe import clip_grad_norm
from poise.train.shard import shard_model
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


class Net(nn.Module):
    """Blocks of odd widths, so that 2 and 3 ranks shard them unevenly (FSDP2 pads)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([nn.Linear(7, 7), nn.Linear(7, 7)])
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


class NoSession:
    """A session with nothing of its own to save (the checkpoint's protocol, nothing more)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "window": None, "comm": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _build(world_size: int, seed: int) -> tuple[nn.Module, AdamW, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = shard_model(Net(), ParallelConfig(mode="fsdp"), CommConfig(), world_size=world_size, nproc=world_size,
                        device=torch.device("cpu"))
    optimizer = AdamW(model.parameters(), lr=0.05, weight_decay=0.01, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _step(model: nn.Module, optimizer: AdamW, scheduler: Any, rank: int, step: int) -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))
    model(x).pow(2).mean().backward()
    clip_grad_norm(model, 0.5)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def _full(model: nn.Module, optimizer: AdamW) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer moment, whole (a collective)."""
    out = {f"model/{n}": p.full_tensor().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state[p].items():
            out[f"optim/{i}/{key}"] = value.full_tensor().clone() if value.dim() else value.clone()
    return out


def _train_and_save(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optimizer, scheduler = _build(world_size, seed=0)
    assert sharded.is_sharded(model)
    for step in range(3):
        _step(model, optimizer, scheduler, rank, step)
    with torch.no_grad():  # an evaluation: the root unit keeps its gathered parameters until resharded
        model(torch.zeros(1, 5))
    state = checkpoint.capture(step=3, model=model, optimizer=optimizer, scheduler=scheduler,
                               session=NoSession(rank), world_size=world_size)
    saved = {k: v.clone() for k, v in state.tensors.items()}  # capture() gives references, as for DDP
    whole = _full(model, optimizer)
    if rank == 0:
        torch.save({"tensors": state.tensors, "shared": state.shared}, path)
    else:
        assert state.tensors == {}  # only rank 0 holds (and writes) the full tensors
    dist.barrier()
    _step(model, optimizer, scheduler, rank, 3)  # the uninterrupted run's next step
    return {"saved": saved, "whole": whole, "next": _full(model, optimizer)}


def _restore(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model, optimizer, scheduler = _build(world_size, seed=1)  # other weights, no optimizer state
    loaded = torch.load(path, weights_only=True)
    state = checkpoint.TrainingState(loaded["tensors"], loaded["shared"], {})
    problems = checkpoint.live_problems(state, model, optimizer)
    checkpoint.restore(state, model=model, optimizer=optimizer, scheduler=scheduler, session=NoSession(rank))
    restored = _full(model, optimizer)
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    _step(model, optimizer, scheduler, rank, 3)
    return {"problems": problems, "restored": restored, "next": _full(model, optimizer), "local": local,
            "lr": optimizer.param_groups[0]["lr"]}


def test_a_sharded_checkpoint_holds_full_tensors_and_restores_exactly(tmp_path: Path):
    path = str(tmp_path / "state.pt")
    first = run_ranks(_train_and_save, 2, timeout_s=90, path=path)
    saved, whole = first[0]["saved"], first[0]["whole"]
    assert sorted(k for k in saved if k.startswith("model/")) == sorted(
        f"model/{n}" for n, _ in Net().named_parameters())
    assert set(saved) == set(whole)
    for key, value in whole.items():
        assert not isinstance(saved[key], DTensor), key
        torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)

    again = run_ranks(_restore, 2, timeout_s=90, path=path)
    assert again[0]["problems"] == []
    for key, value in whole.items():
        torch.testing.assert_close(again[1]["restored"][key], value, rtol=0, atol=0, msg=key)
    for key, value in first[0]["next"].items():  # the step after the restore: bit for bit
        torch.testing.assert_close(again[0]["next"][key], value, rtol=0, atol=0, msg=key)


def test_a_sharded_checkpoint_restores_on_another_number_of_ranks(tmp_path: Path):
    path = str(tmp_path / "state.pt")
    whole = run_ranks(_train_and_save, 2, timeout_s=90, path=path)[0]["whole"]
    three = run_ranks(_restore, 3, timeout_s=90, path=path)
    assert three[2]["local"]["inp.weight"] == (1, 5)  # 7 rows over 3 ranks: 3, 3, 1
    for rank in range(3):
        assert three[rank]["problems"] == []
        for key, value in whole.items():
            torch.testing.assert_close(three[rank]["restored"][key], value, rtol=0, atol=0, msg=key)
    assert three[0]["lr"] == three[2]["lr"] == pytest.approx(0.05 / 5)  # the schedule went on from step 3
