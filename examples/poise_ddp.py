"""A torchrun DDP script: a small byte-level transformer on Python source, where samples are unequal.

    torchrun --nproc-per-node 2 examples/plain_ddp.py --steps 100
    torchrun --nproc-per-node 2 examples/poise_ddp.py --steps 100 --rank-speed 1:0.5

Every top-level function and class of the standard library is one sample (up to
``--max-len`` bytes), so sample costs range from a few bytes to the cap, as in real
language-model data. ``plain_ddp.py`` is plain DDP; ``poise_ddp.py`` is the same script with
poise added (``diff examples/plain_ddp.py examples/poise_ddp.py``): its session gives the
DataLoader balanced batches, weights each rank's loss so the gradient is exact however
unequal the batches are, measures every rank, re-plans from measured speeds (``dynamic``)
and writes report.json, timeline.png and trace.json into ``--out``. ``--rank-speed 1:0.5``
emulates rank 1 at half speed (``comm="topk"`` in the session would compress gradients).
"""

import argparse
import re
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import poise


class Definitions(Dataset):
    """Top-level ``def``/``class`` blocks of the standard library's sources, as byte tensors."""

    def __init__(self, max_len: int, max_samples: int) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        self.samples: list[bytes] = []
        for path in sorted(root.glob("*.py")):
            text = path.read_bytes()
            starts = [m.start() for m in re.finditer(rb"^(?:def|class) ", text, re.MULTILINE)]
            for a, b in zip(starts, [*starts[1:], len(text)][: len(starts)], strict=True):
                if b - a > 8:
                    self.samples.append(text[a:b][:max_len])
            if len(self.samples) >= max_samples:
                break
        self.lengths = np.array([len(s) for s in self.samples])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.samples[i]), dtype=torch.uint8).long()


def collate(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, padded to the longest sample (targets -100 on padding)."""
    longest = max(len(s) for s in samples)
    inputs = torch.zeros(len(samples), longest - 1, dtype=torch.long)
    targets = torch.full((len(samples), longest - 1), -100, dtype=torch.long)
    for k, s in enumerate(samples):
        inputs[k, : len(s) - 1], targets[k, : len(s) - 1] = s[:-1], s[1:]
    return inputs, targets


class ByteLM(nn.Module):
    def __init__(self, d_model: int, num_layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.embed(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch's real (non-padding) next bytes."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--out", default="runs/example")
    parser.add_argument("--rank-speed", default="", help="emulate slow ranks, e.g. 1:0.5")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = Definitions(args.max_len, max_samples=4000)
    model = DDP(ByteLM(d_model=64, num_layers=2, max_len=args.max_len))
    data = poise.Data(lengths=dataset.lengths, loss_terms=dataset.lengths - 1, batch_size=args.batch_size)
    session = poise.Session(model, data, emulate=args.rank_speed, out_dir=args.out)  # no settings
    sampler = session.sampler
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    done, epoch = 0, 0
    while done < args.steps:
        sampler.set_epoch(epoch)
        for step, (inputs, targets) in session.steps(loader):
            loss = lm_loss(model(inputs), targets)
            step.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if dist.get_rank() == 0 and done in (1, args.steps):
                print(f"step {done} loss {loss.item():.3f}")  # rank 0's batch, nats per byte
            if done == args.steps:
                break
        epoch += 1
    session.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
