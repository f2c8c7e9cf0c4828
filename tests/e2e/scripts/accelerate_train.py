"""attach() end to end: ``torchrun --nproc-per-node 2 accelerate_train.py --out DIR``.

Accelerate on CPU under torchrun (MULTI_CPU, gloo), the toy task for a few steps through a
session loop, the first step's reduced gradient saved for the test to recompute.
"""

from __future__ import annotations

import torch
import toy
from accelerate import Accelerator

from poise.integrations.accelerate import attach


def main() -> None:
    args = toy.parse_args()
    seqs = toy.make_sequences()
    lengths, terms = toy.lengths_and_terms(seqs)
    accelerator = Accelerator(cpu=True)
    model = toy.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    session = attach(accelerator, model, lengths=lengths, loss_terms=terms, batch_size=args.batch_size,
                     balance=args.balance, comm=args.comm, sync=toy.sync_config(args), out_dir=args.out)
    loader = session.dataloader(toy.Sequences(seqs), collate_fn=toy.collate)
    for step, batch in session.steps(loader):
        assert batch["index"].tolist() == step.indices.tolist()
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        step.backward(toy.mean_loss(session.model, batch))
        if step.index == 0:
            toy.save_first_step(args.out, accelerator.process_index, [step.indices.tolist()], session.model.module)
        optimizer.step()
        optimizer.zero_grad()
        if step.index + 1 == args.steps:
            break
    session.finish({"accelerate": {"distributed_type": str(accelerator.distributed_type.value)}})
    accelerator.wait_for_everyone()  # no rank tears gloo down while its peer still talks to it
    accelerator.end_training()  # destroys the process group before the interpreter's teardown


if __name__ == "__main__":
    main()
