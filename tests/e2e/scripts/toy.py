"""The adapters' end-to-end task: next-token prediction on random token sequences of unequal length.

Tiny on purpose (a few thousand parameters, 96 samples of 4 to 48 tokens): the tests check
wiring and exactness, not learning. Shared by the launched scripts and by the test that
recomputes their first gradient in one process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from poise.config import SyncConfig

VOCAB = 32
NUM_SAMPLES = 96
IGNORE = -100


def make_sequences(seed: int = 0) -> list[torch.Tensor]:
    """``NUM_SAMPLES`` token sequences of 4 to 48 tokens, the same in every process."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 49, size=NUM_SAMPLES)
    return [torch.from_numpy(rng.integers(0, VOCAB, size=int(n))).long() for n in lengths]


class Sequences(torch.utils.data.Dataset):
    """Sample ``i``: ``(i, tokens)``; the index comes along so a script can check which batch it got."""

    def __init__(self, seqs: list[torch.Tensor]) -> None:
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.seqs[i]


def lengths_and_terms(seqs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens per sample (for the sampler) and predicted tokens per sample (the loss's terms)."""
    lengths = np.array([len(s) for s in seqs])
    return lengths, lengths - 1


def collate(items: list[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest sequence; targets are the next tokens, IGNORE where padded."""
    longest = max(len(t) for _, t in items)
    tokens = torch.zeros(len(items), longest, dtype=torch.long)
    targets = torch.full((len(items), longest - 1), IGNORE, dtype=torch.long)
    for row, (_, t) in enumerate(items):
        tokens[row, : len(t)] = t
        targets[row, : len(t) - 1] = t[1:]
    return {"index": torch.tensor([i for i, _ in items]), "tokens": tokens, "targets": targets}


class TinyLM(nn.Module):
    """Embedding, one hidden layer over the current and previous token, and a vocabulary head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.hidden = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = self.embed(tokens[:, :-1])
        prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
        return self.head(torch.tanh(self.hidden(torch.cat([e, prev], dim=-1))))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def mean_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cross-entropy averaged over the batch's predicted tokens (what ``loss_terms`` counts)."""
    logits = model(batch["tokens"])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1), ignore_index=IGNORE)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--balance", default="cost")
    parser.add_argument("--comm", default="fp16")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--sync", default="step", help="poise.SyncConfig's mode")
    parser.add_argument("--inner-steps", type=int, default=20, help="poise.SyncConfig's inner_steps")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--resume", type=Path, default=None, help="a Lightning checkpoint to continue from")
    return parser.parse_args()


def sync_config(args: argparse.Namespace) -> SyncConfig:
    """The session's ``sync=`` from the flags."""
    return SyncConfig(mode=args.sync, inner_steps=args.inner_steps)


def save_first_step(out: Path, rank: int, batches: list[list[int]], model: nn.Module) -> None:
    """This rank's batches of the first optimizer step (one per micro-batch) and the gradient
    after DDP's reduction (the same on every rank)."""
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.save({"batches": batches, "grads": grads}, out / f"first_step_rank{rank}.pt")
