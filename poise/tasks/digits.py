"""The ``digits`` task: a small CNN on scikit-learn's bundled 8x8 handwritten digits.

It is the cheap, fixed-cost counterpart of ``code-lm``: 1,797 images that ship with
scikit-learn (no download), every sample costs the same, and a sound model reaches 95 %
test accuracy in well under a hundred steps, so distributed runs can check convergence in
seconds. The train/test split is fixed (stratified 80/20, ``random_state=0``) and does not
depend on the run seed, so every run evaluates on the same 360 images.
"""

from __future__ import annotations

import importlib.metadata
import logging
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from poise.files import write_atomic
from poise.tasks.base import Batch, EvalSums, Task

logger = logging.getLogger(__name__)

NUM_CLASSES = 10
TEST_FRACTION = 0.2
SPLIT_RANDOM_STATE = 0
"""Fixed so the split is the same for every run seed."""

_PIXEL_MAX = 16.0  # load_digits pixels are integers in [0, 16]


class DigitsDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style dataset; item ``i`` is ``(image [1, 8, 8] float32 in [0, 1], label int64)``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


_SPLIT_SIZES = (1437, 360)
_CACHE_MAX_BYTES = 4 << 20  # the split is about 0.5 MB: anything far larger is not ours


def load_digits_split(cache_dir: Path | None = None) -> tuple[DigitsDataset, DigitsDataset]:
    """Return ``(train, test)``: 1,437 and 360 images, stratified by class.

    ``cache_dir``: where the split is kept after its first computation (one ``.npz`` per
    scikit-learn version). Why: importing scikit-learn costs about a second per worker, and
    a node's workers build the task one after the other, so every start and every elastic
    restart of a digits job paid it twice. A cache that is missing, unreadable or not the
    split's shapes, types and ranges is computed again and rewritten atomically; one that
    cannot be written (a read-only home) only costs the next start the same second.
    """
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"digits-split-sklearn-{importlib.metadata.version('scikit-learn')}.npz"
        cached = _read_split(path)
        if cached is not None:
            return _datasets(*cached)
    arrays = _compute_split()
    if path is not None:
        try:
            write_atomic(path, lambda handle: np.savez(handle, **dict(zip(_KEYS, arrays, strict=True))))
        except OSError as exc:
            logger.debug("digits: split not cached in %s: %s", path, exc)
    return _datasets(*arrays)


_KEYS = ("train_x", "test_x", "train_y", "test_y")


def _compute_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    # Imported here so importing poise.tasks does not pay for scikit-learn.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / _PIXEL_MAX).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    return tuple(train_test_split(images, labels, test_size=TEST_FRACTION, stratify=labels,
                                  random_state=SPLIT_RANDOM_STATE))  # type: ignore[return-value]


def _read_split(path: Path) -> tuple[np.ndarray, ...] | None:
    """The cached split, or None when it is missing or is not exactly what the split is."""
    try:
        if path.stat().st_size > _CACHE_MAX_BYTES:
            return None
        with np.load(path, allow_pickle=False) as data:
            arrays = tuple(data[key] for key in _KEYS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    train_x, test_x, train_y, test_y = arrays
    for x, y, n in ((train_x, train_y, _SPLIT_SIZES[0]), (test_x, test_y, _SPLIT_SIZES[1])):
        if x.shape != (n, 1, 8, 8) or x.dtype != np.float32 or y.shape != (n,) or y.dtype != np.int64:
            return None
        if not (np.all((x >= 0) & (x <= 1)) and np.all((y >= 0) & (y < NUM_CLASSES))):
            return None
    return arrays


def _datasets(train_x: np.ndarray, test_x: np.ndarray, train_y: np.ndarray,
              test_y: np.ndarray) -> tuple[DigitsDataset, DigitsDataset]:
    return (DigitsDataset(torch.from_numpy(train_x), torch.from_numpy(train_y)),
            DigitsDataset(torch.from_numpy(test_x), torch.from_numpy(test_y)))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions (1 -> 16 -> 32 channels), 2x2 max-pool, then a linear classifier.

    About 9.9k parameters; ``[B, 1, 8, 8]`` images -> ``[B, 10]`` logits.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * 4 * 4, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def collate_digits(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Batch:
    """Stack ``(image, label)`` pairs; one token per image.

    Raises:
        ValueError: the batch is empty.
    """
    if not samples:
        raise ValueError("collate_digits got an empty batch; need at least one sample")
    images = torch.stack([image for image, _ in samples])
    labels = torch.stack([label for _, label in samples])
    n = len(samples)
    return Batch(inputs=images, targets=labels, num_samples=n, num_tokens=n, num_padded_tokens=n)


def digits_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy (nats) over the batch's images."""
    return F.cross_entropy(model(batch.inputs), batch.targets)


def digits_eval_sums(model: nn.Module, batch: Batch) -> EvalSums:
    """Summed cross-entropy (nats), correct predictions and image count."""
    logits = model(batch.inputs)
    loss_sum = F.cross_entropy(logits, batch.targets, reduction="sum")
    correct = (logits.argmax(dim=-1) == batch.targets).sum()
    # .item() synchronises with the device; eval runs rarely, so one sync per batch is fine.
    return EvalSums(
        loss_sum=float(loss_sum.item()),
        correct=float(correct.item()),
        count=float(batch.targets.shape[0]),
    )


def build_digits_task(*, seed: int, cache_dir: Path | None = None) -> Task:
    """Build the ``digits`` task.

    Args:
        seed: seeds the model initialisation only; the data split is fixed.
        cache_dir: where the split is cached (None: computed every time).
    """
    train_set, test_set = load_digits_split(cache_dir)

    def build_model() -> nn.Module:
        # Fork the CPU RNG (only: forking every device RNG is slow) so building a model
        # neither depends on nor disturbs the caller's global random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return DigitsCNN()

    return Task(
        name="digits",
        train_set=train_set,
        eval_set=test_set,
        train_lengths=np.ones(len(train_set), dtype=np.int64),
        train_targets=np.ones(len(train_set), dtype=np.int64),
        cost_alpha=0.0,
        build_model=build_model,
        collate=collate_digits,
        train_loss=digits_loss,
        eval_sums=digits_eval_sums,
        loss_unit="nats/sample",
        default_batch_size=32,
        default_lr=1e-2,
    )
