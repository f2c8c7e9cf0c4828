"""Packed rows through poise.Session on real gloo ranks: the balanced split gives unequal
batches (other pieces, other row counts), and the weighted loss makes the step's gradient
the one a single process computes over the whole step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import poise
from poise.tasks.code_lm import ByteTransformer, code_lm_loss, collate_packed
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

ROW = 64
DOCS = np.random.default_rng(1).lognormal(3.2, 1.0, size=120).astype(np.int64) + 2  # a few longer than a row


class Documents(Dataset):
    """Document i: DOCS[i] random bytes."""

    def __len__(self) -> int:
        return len(DOCS)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(i))
        return torch.randint(0, 256, (int(DOCS[i]),), generator=g, dtype=torch.uint8)


def _model() -> ByteTransformer:
    torch.manual_seed(0)
    return ByteTransformer(max_seq_len=ROW, d_model=16, num_layers=1, num_heads=2)


def collate(samples: list[torch.Tensor]):
    return collate_packed(samples, row_tokens=ROW)


def _packed_step(rank: int, world_size: int) -> dict:
    data = poise.Data(lengths=DOCS, row_tokens=ROW, batch_size=3, dataset=Documents())
    session = poise.Session(_model(), data, balance="auto")
    session.sampler.set_speeds([1.0, 3.0])  # rank 1 "three times faster": it gets about 3x the cost
    loader = session.dataloader(Documents(), collate_fn=collate)
    for step, batch in session.steps(loader):
        step.backward(code_lm_loss(session.model, batch))
        return {"batches": [b.tolist() for b in session.sampler.global_batches(step.position)],
                "rows": len(batch.rows), "pieces": session.sampler.pieces,
                "grads": [p.grad.clone() for p in session.model.parameters()]}
    raise AssertionError("no step")


def test_a_packed_balanced_step_gives_the_gradient_of_the_whole_step():
    results = run_ranks(_packed_step, world_size=2, timeout_s=90)
    batches = results[0]["batches"]
    assert batches == results[1]["batches"]  # every rank planned the same split
    assert results[0]["rows"] != results[1]["rows"]  # unequal: rows per rank differ
    pieces, dataset = results[0]["pieces"], Documents()
    everything = [i for b in batches for i in b]
    samples = [dataset[int(pieces.doc[i])][pieces.start[i]:pieces.start[i] + pieces.lengths[i]] for i in everything]
    reference = _model()
    code_lm_loss(reference, collate(samples)).backward()  # one process, the step's every token
    for rank_result in results:
        for got, want in zip(rank_result["grads"], [p.grad for p in reference.parameters()], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
