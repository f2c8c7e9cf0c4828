"""A Hugging Face user's own script with poise: ``torchrun --nproc-per-node 2 examples/hf_accelerate.py --out DIR``.

A random-init GPT-2 from ``transformers`` learns byte tokens of the standard library's
docstrings (samples of very unequal length) under Accelerate on the CPU, through
``poise.integrations.accelerate.attach``. The loss is Hugging Face's: the model shifts its
labels and averages over the tokens whose label is not -100, so the step counts those terms
in the batch in hand (``step.backward(loss, num_items=...)``) for the exact gradient; with
``--count-from-labels`` it passes no count and the session counts them from ``labels=``.

``--check-gradient``: rank 0 recomputes the first step's gradient in one process on the union
of both ranks' (unequal) batches and prints the largest relative difference.
``--prepare-loader``: the Accelerate habit of passing the session's loader through
``accelerator.prepare`` (refused before the first step trains, in ``session.steps`` and, with
``--step-context``, in ``session.step()``).
``--check-misuse``: rank 0 prints the one line each of three mistakes gets (``refused: ...``):
clipping before the step's backward, a second ``attach`` on the prepared model, and the
former keyword ``rank_speed``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import poise
from poise.integrations.accelerate import attach

PAD = 256  # byte tokens 0..255, and padding
MAX_LEN = 96


def docstrings() -> list[bytes]:
    """Every docstring of a few standard-library modules, as bytes, in a fixed order."""
    import collections
    import json as json_mod
    import pathlib
    import textwrap

    texts = []
    for module in (collections, json_mod, pathlib, textwrap, inspect):
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and len(doc) > 8:
                texts.append(doc.encode()[:MAX_LEN])
    return texts


class Docstrings(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.texts = docstrings()
        self.lengths = [len(t) for t in self.texts]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(list(self.texts[i]), dtype=torch.long)


def collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(s) for s in samples)
    ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
    for k, s in enumerate(samples):
        ids[k, : len(s)] = s
    labels = ids.masked_fill(ids == PAD, -100)  # the model shifts them itself
    return {"input_ids": ids, "labels": labels, "attention_mask": (ids != PAD).long()}


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=PAD + 1, n_positions=MAX_LEN, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: gradients compare exactly
                        pad_token_id=PAD, bos_token_id=PAD, eos_token_id=PAD)
    return GPT2LMHeadModel(config)


def terms(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The terms Hugging Face's causal-LM loss averages over: shifted labels that are not -100."""
    return (batch["labels"][:, 1:] != -100).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--emulate", default="", help="e.g. 1:0.5 (rank 1 at half speed)")
    parser.add_argument("--check-gradient", action="store_true")
    parser.add_argument("--prepare-loader", action="store_true")
    parser.add_argument("--step-context", action="store_true", help="`with session.step()` instead of session.steps")
    parser.add_argument("--balance", default="dynamic", help="static | cost | dynamic")
    parser.add_argument("--count-from-labels", action="store_true", help="no num_items: counted from labels=")
    parser.add_argument("--check-misuse", action="store_true")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING)
    accelerator = Accelerator(cpu=True)
    dataset = Docstrings()
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net, optimizer = accelerator.prepare(net, optimizer)
    settings = {"lengths": dataset.lengths, "batch_size": 8, "balance": args.balance, "out_dir": args.out,
                "total_steps": args.steps}
    session = attach(accelerator, net, emulate=args.emulate or None, **settings)
    if args.check_misuse:
        refused(lambda: attach(accelerator, net, **settings), session.rank)
        refused(lambda: attach(accelerator, net, rank_speed="1:0.5", **settings), session.rank)
    loader = session.dataloader(dataset, collate_fn=collate)
    if args.prepare_loader:
        loader = accelerator.prepare(loader)
    steps = ((session.step(), batch) for batch in loader) if args.step_context else session.steps(loader)
    for k, (step, batch) in enumerate(steps):
        loss = session.model(**batch).loss
        if k == 0 and args.check_misuse:
            refused(lambda: accelerator.clip_grad_norm_(session.model.parameters(), 1.0), session.rank)
        step.backward(loss, num_items=None if args.count_from_labels else terms(batch))
        if k == 0 and args.check_gradient:
            check_gradient(session, dataset, step.position)
        optimizer.step()
        optimizer.zero_grad()
        if args.step_context:
            step.end()
        if k + 1 == args.steps:
            break
    session.finish()
    accelerator.end_training()
    if dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"done": True, "report": str(Path(args.out) / "report.json")}))


def refused(mistake: Callable[[], object], rank: int) -> None:
    """Run ``mistake``, which poise must refuse in one line; rank 0 prints that line."""
    try:
        mistake()
    except ValueError as exc:
        if rank == 0:
            print(f"refused: {exc}", flush=True)
        return
    raise AssertionError("poise accepted a mistake")


def check_gradient(session: poise.Session, dataset: Docstrings, position: int) -> None:
    """Rank 0: the first step's reduced gradient against one process's on both ranks' batches."""
    if session.rank != 0:
        return
    union = [int(i) for b in session.sampler.global_batches(position) for i in b]
    reference = model()
    reference(**collate([dataset[i] for i in union])).loss.backward()
    got = dict(session.model.module.named_parameters())
    worst = 0.0
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        diff = (got[name].grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)
        worst = max(worst, float(diff))
    print(f"gradient max relative difference {worst:.2e}", flush=True)


if __name__ == "__main__":
    main()
