"""The FSDP2 adapter runs' shared parts: the toy model sharded with ``fully_shard`` (each layer,
then the root), the flags, and what a run leaves for the test (each step's batches on this rank
and the full parameters at the end), so the test can replay the run in one process."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import toy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def shard(model: toy.TinyLM, mesh: object = None) -> toy.TinyLM:
    """``fully_shard`` each layer, then the root (on ``mesh``; None: every rank)."""
    for layer in (model.embed, model.hidden, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", default="", help="which way the model is sharded (the script says)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--comm", default="none")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", type=Path, default=None, help="a Lightning checkpoint to continue from")
    parser.add_argument("--save-every", type=int, default=0, help="Lightning: a checkpoint every N optimizer steps")
    return parser.parse_args()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: every rank calls it)."""
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def save_run(out: Path, rank: int, batches: list[list[int]], syncs: list[bool], model: nn.Module,
             **extra: object) -> None:
    """This rank's batches (one list of sample indices per micro-batch, in order), whether each
    micro-batch ended an optimizer step, and the model's full parameters after the last step."""
    params = full_params(model)
    torch.save({"batches": batches, "syncs": syncs, "params": params, **extra}, out / f"fsdp_rank{rank}.pt")
