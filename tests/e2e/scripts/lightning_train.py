"""PoiseStrategy end to end: ``torchrun --nproc-per-node 2 lightning_train.py --out DIR``.

Trains the toy task for one epoch, then validates (that loader must be left alone),
checks on every batch that the batch in hand is the one the open poise step weights,
saves the first step's reduced gradient for the test to recompute, and leaves the report
and a checkpoint in ``--out``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import toy
from torch.utils.data import DataLoader

from poise.integrations.lightning import PoiseStrategy


class ToyModule(pl.LightningModule):
    def __init__(self, dataset: toy.Sequences, out) -> None:
        super().__init__()
        self.net, self.dataset, self.out = toy.make_model(), dataset, out
        self.batches: list[list[int]] = []  # this rank's batches until the first optimizer step

    def train_dataloader(self) -> DataLoader:
        # shuffle and batch_size are replaced by poise's balanced batch sampler
        return DataLoader(self.dataset, batch_size=4, shuffle=True, collate_fn=toy.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=8, collate_fn=toy.collate)

    def training_step(self, batch, batch_idx):
        step = self.trainer.strategy.step
        # Lightning prefetches a batch: the step must still be the one of the batch in hand
        assert batch["index"].tolist() == step.indices.tolist(), (batch_idx, step.index)
        if self.batches is not None:
            self.batches.append(step.indices.tolist())
        loss = toy.mean_loss(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", toy.mean_loss(self.net, batch), sync_dist=True)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.batches is not None:  # gradients are reduced by now
            toy.save_first_step(self.out, self.global_rank, self.batches, self.net)
            self.batches = None

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)


def main() -> None:
    args = toy.parse_args()
    seqs = toy.make_sequences()
    lengths, terms = toy.lengths_and_terms(seqs)
    dataset = toy.Sequences(seqs)
    strategy = PoiseStrategy(lengths=lengths, loss_terms=terms, batch_size=args.batch_size, balance=args.balance,
                             comm=args.comm, sync=toy.sync_config(args), out_dir=args.out)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
                         accumulate_grad_batches=args.accumulate,
                         limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.out)
    trainer.fit(ToyModule(dataset, args.out), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
