"""PoiseFSDPStrategy end to end: ``torchrun --nproc-per-node 2 lightning_fsdp_train.py --out DIR [--accumulate N]``.

The toy LightningModule shards its model in ``configure_model`` (``fully_shard`` on the
data-parallel mesh: each layer, then the model) and trains ``--steps`` optimizer steps
through poise's FSDP2 strategy on gloo; each rank's batches and the final full parameters
are saved for the test to replay in one process, beside the report and a checkpoint.
"""

from __future__ import annotations

import fsdp_toy
import lightning.pytorch as pl
import torch
import toy
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from poise.integrations.lightning import PoiseFSDPStrategy


class ToyModule(pl.LightningModule):
    def __init__(self, dataset: toy.Sequences) -> None:
        super().__init__()
        self.net, self.dataset = toy.make_model(), dataset
        self.batches: list[list[int]] = []  # this rank's micro-batches, in order
        self.syncs: list[bool] = []  # whether each ended an optimizer step

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        fsdp_toy.shard(self.net, mesh)

    def train_dataloader(self) -> DataLoader:
        # shuffle and batch_size are replaced by poise's balanced batch sampler
        return DataLoader(self.dataset, batch_size=4, shuffle=True, collate_fn=toy.collate)

    def training_step(self, batch, batch_idx):
        step = self.trainer.strategy.step
        assert batch["index"].tolist() == step.indices.tolist(), (batch_idx, step.index)
        self.batches.append(step.indices.tolist())
        self.syncs.append(step.sync)
        loss = toy.mean_loss(self.net, batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.05)


def main() -> None:
    args = fsdp_toy.parse_args()
    seqs = toy.make_sequences()
    lengths, terms = toy.lengths_and_terms(seqs)
    dataset = toy.Sequences(seqs)
    strategy = PoiseFSDPStrategy(lengths=lengths, loss_terms=terms, batch_size=args.batch_size, balance="cost",
                                 comm=args.comm, out_dir=args.out)
    callbacks = []
    if args.save_every:  # mid-epoch checkpoints, every one kept
        callbacks.append(ModelCheckpoint(dirpath=args.out / "every", every_n_train_steps=args.save_every,
                                         save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, callbacks=callbacks,
                         accumulate_grad_batches=args.accumulate, num_sanity_val_steps=0, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out)
    module = ToyModule(dataset)
    trainer.fit(module, ckpt_path=args.resume)
    fsdp_toy.save_run(args.out, trainer.global_rank, module.batches, module.syncs, module.net,
                      model_type=type(strategy.session.model).__name__, global_step=trainer.global_step)


if __name__ == "__main__":
    main()
