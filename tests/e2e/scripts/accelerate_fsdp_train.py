"""attach() on FSDP2: ``torchrun --nproc-per-node 2 accelerate_fsdp_train.py --mode M --out DIR``.

Modes (the toy task, SGD, a few steps through a session loop; each rank's batches and the
final full parameters are saved for the test to replay in one process):

- ``own``: ``Accelerator(cpu=True)`` (MULTI_CPU on gloo); the model sharded here with
  ``fully_shard``, only the optimizer prepared: how FSDP2 runs through Accelerate on CPU.
- ``prepare``: Accelerate's own FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``,
  ``prepare(model, optimizer)`` shards the model). Accelerate 1.15 selects its FSDP type on
  accelerators only (with ``cpu=True`` it drops the plugin and prepares DDP), so this mode
  sets the type Accelerate sets on a GPU machine before preparing; the sharding, optimizer
  and backward are then Accelerate's FSDP2 code, on gloo.
- ``session``: no Accelerate: ``poise.Session`` on the same ``fully_shard`` model (the reference).
- ``refusals``: what attach() refuses, each message written to ``refused.json``.
"""

from __future__ import annotations

import json

import fsdp_toy
import torch
import torch.distributed as dist
import toy
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

import poise
from poise.integrations.accelerate import attach


def refusals(args) -> None:
    """attach()'s one-line refusals on this machine, by case."""
    out: dict[str, str] = {}

    def refused(case: str, accelerator: Accelerator, model: torch.nn.Module) -> None:
        try:
            attach(accelerator, model, lengths=[1, 2], batch_size=2, out_dir=args.out)
        except ValueError as e:
            out[case] = str(e)

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    out["distributed_type_with_plugin"] = accelerator.distributed_type.value
    model, _ = accelerator.prepare(toy.make_model(), torch.optim.SGD(toy.make_model().parameters(), lr=0.1))
    refused("plugin_dropped_on_cpu", accelerator, model)  # Accelerate prepared DDP: not sharded
    state = accelerator.state
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, FullyShardedDataParallelPlugin(fsdp_version=1)
    refused("fsdp1", accelerator, model)
    state.fsdp_plugin = plugin
    refused("fsdp2_not_prepared", accelerator, model)
    state.distributed_type = DistributedType.DEEPSPEED
    refused("deepspeed", accelerator, model)
    if accelerator.is_main_process:
        (args.out / "refused.json").write_text(json.dumps(out, indent=1))
    state.distributed_type = DistributedType.MULTI_CPU
    accelerator.wait_for_everyone()
    accelerator.end_training()


def main() -> None:
    args = fsdp_toy.parse_args()
    if args.mode == "refusals":
        return refusals(args)
    seqs = toy.make_sequences()
    lengths, terms = toy.lengths_and_terms(seqs)
    model = toy.make_model()
    accelerator = None
    if args.mode == "session":
        dist.init_process_group("gloo")
        fsdp_toy.shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    elif args.mode == "own":
        accelerator = Accelerator(cpu=True)
        fsdp_toy.shard(model)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    elif args.mode == "prepare":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # what Accelerate selects on a GPU machine (it keeps MULTI_CPU on CPU): see the module doc.
        # Both states: AcceleratorState copies PartialState's type whenever it is made again.
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type, accelerator.state.fsdp_plugin = DistributedType.FSDP, plugin
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    else:
        raise SystemExit(f"--mode {args.mode!r}: own, prepare, session or refusals")
    kwargs = {"lengths": lengths, "loss_terms": terms, "batch_size": args.batch_size, "balance": "cost",
              "comm": args.comm, "accum_steps": args.accumulate, "out_dir": args.out}
    session = poise.Session.from_kwargs(model, **kwargs) if accelerator is None else attach(accelerator, model,
                                                                                             **kwargs)
    loader = session.dataloader(toy.Sequences(seqs), collate_fn=toy.collate)
    batches: list[list[int]] = []
    syncs: list[bool] = []
    for step, batch in session.steps(loader):
        assert batch["index"].tolist() == step.indices.tolist()
        batches.append(step.indices.tolist())
        syncs.append(step.sync)
        step.backward(toy.mean_loss(session.model, batch))
        if step.sync:
            optimizer.step()
            optimizer.zero_grad()
            if (step.index + 1) // args.accumulate == args.steps:
                break
    kind = accelerator.distributed_type.value if accelerator is not None else "none"
    fsdp_toy.save_run(args.out, dist.get_rank(), batches, syncs, session.module, distributed_type=kind,
                      model_type=type(session.model).__name__)
    session.finish({"accelerate": {"distributed_type": kind}})
    if accelerator is not None:
        accelerator.wait_for_everyone()  # no rank tears gloo down while its peer still talks to it
        accelerator.end_training()
    else:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
