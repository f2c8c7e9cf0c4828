"""PoiseStrategy on one GPU: ``python tests/cuda/lightning_gpu.py --out DIR`` (run by
``test_lightning_cuda.py``).

Lightning's ``accelerator="gpu", devices=1`` with poise's strategy: a world of one NCCL rank
in this process, the toy task of the integration tests (``tests/e2e/scripts/toy.py``) for one
epoch with fp16 compression; the report lands in ``--out``. The test puts this checkout and
``tests/e2e/scripts`` on ``PYTHONPATH``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import toy
from torch.utils.data import DataLoader

from poise.integrations.lightning import PoiseStrategy


class ToyModule(pl.LightningModule):
    def __init__(self, dataset: toy.Sequences) -> None:
        super().__init__()
        self.net, self.dataset = toy.make_model(), dataset
        self.devices: set[str] = set()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=4, shuffle=True, collate_fn=toy.collate)

    def training_step(self, batch, batch_idx):
        step = self.trainer.strategy.step
        assert batch["index"].tolist() == step.indices.tolist(), (batch_idx, step.index)
        self.devices.add(str(batch["tokens"].device))
        return toy.mean_loss(self.net, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)

    def on_train_end(self) -> None:
        assert all(d.startswith("cuda") for d in self.devices), self.devices  # Lightning moved batches to the GPU
        assert all(p.is_cuda for p in self.net.parameters())


def main() -> None:
    args = toy.parse_args()
    seqs = toy.make_sequences()
    lengths, terms = toy.lengths_and_terms(seqs)
    strategy = PoiseStrategy(lengths=lengths, loss_terms=terms, batch_size=args.batch_size, balance=args.balance,
                             comm=args.comm, out_dir=args.out)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_epochs=args.epochs,
                         num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=args.out)
    trainer.fit(ToyModule(toy.Sequences(seqs)))


if __name__ == "__main__":
    main()
