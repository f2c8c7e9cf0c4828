"""Packed rows (poise/balance/packing.py): the planner and the sampler as pure functions, and
code-lm's packed collate and document attention."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from poise.balance import balance
from poise.balance.costs import AttentionCost
from poise.balance.packed_sampler import PackedBatchSampler, make_packed_sampler
from poise.balance.packing import (
    cut_pieces,
    packed_steps,
    rows_in_order,
    split_naive,
    split_packed,
)
from poise.tasks.base import IGNORE_INDEX
from poise.tasks.code_lm import ByteTransformer, code_lm_loss, collate_bytes, collate_packed

ROW = 512
# documents with a long tail like source files' (a few longer than a row)
DOCS = np.random.default_rng(0).lognormal(4.8, 1.2, size=900).astype(np.int64) + 2
COST = AttentionCost(1.0 / (6 * 128))


def test_long_documents_are_cut_at_the_row_length():
    pieces = cut_pieces([5, 512, 513, 1300], ROW)
    assert pieces.lengths.tolist() == [5, 512, 512, 1, 512, 512, 276]
    assert pieces.doc.tolist() == [0, 1, 2, 2, 3, 3, 3]
    assert pieces.start.tolist() == [0, 0, 0, 512, 0, 512, 1024]
    assert pieces.first.tolist() == [0, 1, 2, 4, 7]


@pytest.mark.parametrize("naive", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_every_piece_is_trained_exactly_once_per_epoch_in_rows_no_longer_than_a_row(naive, world):
    sampler = PackedBatchSampler(DOCS, rank=0, world_size=world, row_tokens=ROW, rows_per_rank=4, cost_fn=COST,
                                 seed=3, naive=naive)
    sampler.set_speeds(np.linspace(1.0, 0.5, world))
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        seen = []
        for j in range(len(sampler)):
            batches = sampler.global_batches(j)
            assert all(len(b) for b in batches)  # every rank trains in every step
            for b in batches:
                assert all(sum(int(sampler.lengths[p]) for p in b[a:e]) <= ROW
                           for a, e in rows_in_order(sampler.lengths[b], ROW))
            seen += [int(p) for b in batches for p in b]
        assert sorted(seen) == list(range(len(sampler.lengths)))  # each piece once: each document whole
        assert np.array_equal(np.bincount(sampler.pieces.doc[seen], weights=sampler.lengths[seen]), DOCS)


def test_both_packers_train_the_same_pieces_in_every_step():
    kw = {"rank": 0, "world_size": 2, "row_tokens": ROW, "rows_per_rank": 4, "cost_fn": COST, "seed": 1}
    naive, packed = PackedBatchSampler(DOCS, naive=True, **kw), PackedBatchSampler(DOCS, **kw)
    assert len(naive) == len(packed)
    for j in range(len(naive)):
        assert sorted(np.concatenate(naive.global_batches(j)).tolist()) == \
            sorted(np.concatenate(packed.global_batches(j)).tolist())
        rows = [len(rows_in_order(naive.lengths[b], ROW)) for b in naive.global_batches(j)]
        assert max(rows) - min(rows) <= 1  # the naive packer: equal rows per rank


def test_a_packed_sampler_resumes_mid_epoch_where_it_stopped():
    kw = {"rank": 1, "world_size": 2, "row_tokens": ROW, "batch_size": 4, "cost_fn": COST, "seed": 2}
    first = make_packed_sampler("auto", DOCS, **kw)
    first.set_speeds([1.0, 0.6])
    handed = [batch for _, batch in zip(range(5), first, strict=False)]
    state = first.state_dict()
    rest = list(first)
    again = make_packed_sampler("auto", DOCS, **kw)
    again.load_state_dict(state)
    again.set_epoch(0)
    assert [list(b) for b in again] == rest and len(handed) == 5


def test_the_planner_balances_what_the_naive_packer_cannot_and_says_its_cost():
    """Predicted balance (the cost model's, with injected speeds) over an epoch's steps; the
    planning time is printed, not asserted (a busy machine's clock decides nothing here)."""
    pieces = cut_pieces(DOCS, ROW)
    steps = packed_steps(pieces, row_tokens=ROW, rows_per_step=16, seed=0, epoch=0, num_ranks=2)
    for speeds, naive_below, packed_above in (((1.0, 1.0), 0.95, 0.96), ((1.0, 0.5), 0.6, 0.93)):
        speeds_a = np.array(speeds)
        naive = [balance(split_naive(s, pieces.lengths, COST, speeds_a, row_tokens=ROW).predicted_s) for s in steps]
        started = time.perf_counter()
        packed = [balance(split_packed(s, pieces.lengths, COST, speeds_a, row_tokens=ROW).predicted_s)
                  for s in steps]
        per_step_ms = (time.perf_counter() - started) / len(steps) * 1e3
        print(f"speeds {speeds}: naive {np.mean(naive):.3f}, poise {np.mean(packed):.3f}, "
              f"planning {per_step_ms:.2f} ms per step of {np.mean([len(s) for s in steps]):.0f} pieces")
        assert np.mean(naive) < naive_below and np.mean(packed) > packed_above


def test_the_collate_rebuilds_the_planned_rows():
    pieces = cut_pieces(DOCS, ROW)
    step = packed_steps(pieces, row_tokens=ROW, rows_per_step=16, seed=0, epoch=0, num_ranks=2)[3]
    split = split_packed(step, pieces.lengths, COST, np.array([1.0, 0.5]), row_tokens=ROW)
    for rows, batch in zip(split.rows, split.batches, strict=True):
        samples = [torch.zeros(int(pieces.lengths[p]), dtype=torch.uint8) for p in batch]
        collated = collate_packed(samples, row_tokens=ROW)
        assert collated.rows == tuple(tuple(int(pieces.lengths[p]) for p in row) for row in rows)
        assert collated.inputs.shape == (len(rows), ROW)


def _model() -> ByteTransformer:
    torch.manual_seed(0)
    return ByteTransformer(max_seq_len=64, d_model=32, num_layers=2, num_heads=4).eval()


def test_a_packed_row_computes_what_each_document_alone_does():
    """A token never attends across documents: each document's logits in a packed row equal
    the document run alone (positions from 0), to float tolerance; so does the loss."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in (20, 7, 30, 64, 2, 50)]
    model = _model()
    batch = collate_packed(docs, row_tokens=64)
    assert batch.rows == ((20, 7, 30), (64,), (2, 50))
    with torch.no_grad():
        packed = model(batch.inputs, batch.rows)
        for r, row in enumerate(batch.rows):
            start = 0
            for n in row:
                doc = batch.inputs[r:r + 1, start:start + n]
                torch.testing.assert_close(packed[r:r + 1, start:start + n], model(doc), rtol=1e-5, atol=1e-5)
                start += n
        alone = sum(code_lm_loss(model, collate_bytes([d])) * (len(d) - 1) for d in docs) / sum(len(d) - 1
                                                                                                 for d in docs)
        torch.testing.assert_close(code_lm_loss(model, batch), alone, rtol=1e-5, atol=1e-6)
    assert int((batch.targets != IGNORE_INDEX).sum()) == sum(len(d) - 1 for d in docs)


def test_a_changed_document_changes_no_other_documents_output():
    """The document mask, directly: perturbing one document of a row leaves every other
    document's outputs unchanged, and its gradient reaches no other document's inputs."""
    model = _model()
    batch = collate_packed([torch.full((n,), 7, dtype=torch.uint8) for n in (10, 20, 30)], row_tokens=64)
    x = model.token_embedding(batch.inputs).detach().requires_grad_(True)
    positions = model.position_embedding(torch.tensor([list(range(10)) + list(range(20)) + list(range(30)) + [0] * 4]))
    h = x + positions
    for block in model.blocks:
        h = block(h, batch.rows)
    h[0, 10:30].sum().backward()  # the second document's outputs
    grad = x.grad.abs().sum(dim=-1)[0]
    assert grad[10:30].sum() > 0 and grad[:10].sum() == 0 and grad[30:].sum() == 0


def test_the_piece_view_cuts_documents_of_tensors_lists_and_dicts():
    """What session.dataloader loads for a packed session: piece i of the documents, whatever
    the dataset's items are (a Hugging Face example is a dict of equal-length lists)."""
    from poise.run.packed import PieceView

    pieces = cut_pieces([3, 7], 4)
    docs = [{"input_ids": list(range(3)), "source": "a"}, {"input_ids": list(range(10, 17)), "source": "b"}]
    view = PieceView(docs, pieces)
    assert [view[i]["input_ids"] for i in range(len(view))] == [[0, 1, 2], [10, 11, 12, 13], [14, 15, 16]]
    assert view[2]["source"] == "b"
    tensors = PieceView([torch.arange(3), torch.arange(7)], pieces)
    assert tensors[2].tolist() == [4, 5, 6]
    with pytest.raises(ValueError, match="cannot be cut into pieces"):
        PieceView(["abc", "abcdefg"], pieces)[1]


def test_an_epoch_resumed_on_another_number_of_ranks_trains_the_rest_once():
    kw = {"row_tokens": ROW, "batch_size": 4, "cost_fn": COST, "seed": 5}
    two = make_packed_sampler("auto", DOCS, rank=0, world_size=2, **kw)
    done = [int(p) for j in range(6) for b in two.global_batches(j) for p in b]
    two.position = 6
    three = make_packed_sampler("auto", DOCS, rank=0, world_size=3, **kw)
    three.load_state_dict(two.state_dict())
    three.set_epoch(0)
    rest = [int(p) for j in range(len(three)) for b in three.global_batches(j) for p in b]
    assert sorted(done + rest) == list(range(len(three.lengths)))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"lengths": DOCS, "row_tokens": 1, "batch_size": 2}, r"^row_tokens=1 must be an integer >= 2"),
    ({"lengths": DOCS, "row_tokens": 64, "loss_terms": DOCS - 1, "batch_size": 2}, r"loss_terms= does not apply"),
    ({"costs": DOCS, "row_tokens": 64, "batch_size": 2}, r"costs= does not apply"),
    ({"row_tokens": 64, "batch_size": 2}, r"give lengths=, the documents' token counts"),
])
def test_packed_data_refuses_what_it_cannot_take_in_one_line(kwargs, match):
    import poise

    with pytest.raises(ValueError, match=match):
        poise.Data(**kwargs)


def test_a_packed_budget_in_tokens_is_whole_rows():
    assert make_packed_sampler("static", DOCS, rank=0, world_size=2, row_tokens=ROW, batch_tokens=4 * ROW
                               ).rows_per_rank == 4
    with pytest.raises(ValueError, match=r"^batch_tokens=1000 is not a whole number of rows of row_tokens=512$"):
        make_packed_sampler("auto", DOCS, rank=0, world_size=2, row_tokens=ROW, batch_tokens=1000)


def test_a_one_byte_piece_packs_and_a_batch_without_targets_has_a_zero_loss():
    """A document one byte longer than a row leaves a last piece of one byte: no loss term,
    and a batch holding only such pieces (a slow rank's share) has a loss of 0, not NaN."""
    batch = collate_packed([torch.arange(65, dtype=torch.uint8)], row_tokens=64)
    assert batch.rows == ((64,), (1,)) and int((batch.targets != IGNORE_INDEX).sum()) == 63
    alone = collate_packed([torch.tensor([7], dtype=torch.uint8)], row_tokens=64)
    loss = code_lm_loss(_model().train(), alone)
    loss.backward()
    assert float(loss.detach()) == 0.0


def test_hugging_faces_flattening_collator_counts_the_terms_the_session_weighs_by():
    """docs/balancing.md's recipe: DataCollatorWithFlattening over a packed session's pieces
    (read through the piece view) leaves out each document's first label, so a causal LM's
    shifted loss averages over exactly the sampler's loss terms of those pieces."""
    from transformers import DataCollatorWithFlattening

    from poise.run.packed import PieceView

    sampler = make_packed_sampler("auto", DOCS, rank=0, world_size=2, row_tokens=ROW, batch_size=2, cost_fn=COST)
    view = PieceView([{"input_ids": list(range(int(n)))} for n in DOCS], sampler.pieces)
    for batch in sampler.global_batches(0):
        flat = DataCollatorWithFlattening()([view[int(i)] for i in batch])
        shifted = flat["labels"][..., 1:]
        assert int((shifted != IGNORE_INDEX).sum()) == int(sampler.piece_terms()[batch].sum())
        assert flat["position_ids"][0].tolist() == [p for i in batch for p in range(int(sampler.lengths[i]))]


def test_a_document_whose_tokens_are_not_its_given_length_is_refused():
    """lengths= that disagrees with the dataset would train empty, cut-off or extra tokens: refused
    when the piece is loaded, naming the document, for sequences and Hugging Face dicts alike."""
    from poise.run.packed import PieceView

    for dataset in ([torch.arange(5), torch.arange(3)], [{"input_ids": list(range(5))}, {"input_ids": [1, 2, 3]}]):
        for lengths in ([10, 3], [3, 3]):
            view = PieceView(dataset, cut_pieces(lengths, 4))
            with pytest.raises(ValueError, match="document 0"):
                view[0]
        piece = PieceView(dataset, cut_pieces([5, 3], 4))[1]  # the right counts: document 0's last byte
        assert list(piece["input_ids"] if isinstance(piece, dict) else piece.tolist()) == [4]


def test_loss_terms_with_a_packed_sampler_of_ones_own_are_refused():
    """A packed step is weighed by its pieces' own terms: loss_terms= beside a packed sampler would
    be dropped without a word, so it is refused in one line."""
    from poise.config import BalanceConfig
    from poise.run.data import Data, plan_sampler

    sampler = make_packed_sampler("auto", np.array([10, 3, 7, 20, 5, 9, 4, 6]), rank=0, world_size=2, row_tokens=8,
                                  batch_size=1, batch_tokens=None, cost_fn=AttentionCost(0.01), seed=0)
    with pytest.raises(ValueError, match="give no loss_terms"):
        plan_sampler(Data(sampler=sampler, loss_terms=[1.0] * len(sampler.lengths)), BalanceConfig(), 0, 2)
    assert plan_sampler(Data(sampler=sampler), BalanceConfig(), 0, 2) is sampler
