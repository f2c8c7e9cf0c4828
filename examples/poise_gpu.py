"""poise on GPUs with NCCL, or on the CPU with gloo: the script picks its device by itself.

    torchrun --nproc-per-node 2 examples/poise_gpu.py --steps 40
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        examples/poise_gpu.py --steps 1000      # the same command on each of two machines

With CUDA, each process takes the GPU of its ``LOCAL_RANK`` (``torch.cuda.set_device``) and
joins an NCCL process group; the model is moved to that GPU before ``poise.Session`` wraps it
in DDP (the session reads the device from the model's parameters), and every batch is moved
there too. Without CUDA the same code runs on the CPU with gloo. docs/gpu.md says what poise
does differently on CUDA.

The data is synthetic so that the script needs no download: each sample counts up from a
random byte for a random length (8 to ``--max-len`` tokens), so samples cost very different
amounts, as sentences do; the model (an embedding and a small MLP) learns the next byte.
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import poise


class Counting(Dataset):
    """Samples of unequal length: ``(start + i) % 256`` for ``i`` below the sample's length."""

    def __init__(self, num_samples: int, max_len: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(8, max_len + 1, size=num_samples)
        self.starts = rng.integers(0, 256, size=num_samples)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return (self.starts[i] + torch.arange(int(self.lengths[i]))) % 256


def collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, padded to the longest sample (targets -100 on padding)."""
    longest = max(len(s) for s in samples)
    inputs = torch.zeros(len(samples), longest - 1, dtype=torch.long)
    targets = torch.full((len(samples), longest - 1), -100, dtype=torch.long)
    for k, s in enumerate(samples):
        inputs[k, : len(s) - 1], targets[k, : len(s) - 1] = s[:-1], s[1:]
    return inputs, targets


def pick_device() -> tuple[torch.device, str]:
    """This process's GPU and NCCL when CUDA is there (one GPU per process, by LOCAL_RANK), else the
    CPU and gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)  # before the process group: NCCL binds to the current device
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--out", default="runs/gpu-example")
    args = parser.parse_args()
    device, backend = pick_device()
    dist.init_process_group(backend)
    torch.manual_seed(0)
    dataset = Counting(num_samples=20_000, max_len=args.max_len)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 256)).to(device)
    data = poise.Data(lengths=dataset.lengths, loss_terms=dataset.lengths - 1, batch_size=args.batch_size,
                      total_steps=args.steps)
    session = poise.Session(model, data, out_dir=args.out)  # wraps the model in DDP on its device
    loader = DataLoader(dataset, batch_sampler=session.sampler, collate_fn=collate,
                        pin_memory=device.type == "cuda")
    optimizer = torch.optim.AdamW(session.model.parameters(), lr=3e-3)
    done, epoch = 0, 0
    while done < args.steps:
        session.sampler.set_epoch(epoch)
        for step, (inputs, targets) in session.steps(loader):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            logits = session.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
            step.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if dist.get_rank() == 0 and done in (1, args.steps):
                print(f"step {done} loss {loss.item():.3f} on {device} ({backend})")
            if done == args.steps:
                break
        epoch += 1
    session.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
