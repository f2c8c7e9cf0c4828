"""Unit tests for the ``code-lm`` and ``digits`` tasks (data, cache, collate, models, losses)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from poise.tasks import stdlib_corpus
from poise.tasks.base import IGNORE_INDEX, Task
from poise.tasks.code_lm import ByteTransformer, build_code_lm_task, collate_bytes
from poise.tasks.digits import build_digits_task, load_digits_split
from poise.tasks.stdlib_corpus import (
    Corpus,
    corpus_stats,
    extract_definitions,
    is_validation_file,
    load_corpus,
    split_indices,
)

SMALL_MODEL = {"d_model": 32, "num_layers": 2, "num_heads": 4}


@pytest.fixture(scope="module")
def stdlib_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory holding the real stdlib index, built once for this module."""
    cache_dir = tmp_path_factory.mktemp("code_lm_cache")
    assert not load_corpus(cache_dir).from_cache
    return cache_dir


@pytest.fixture(scope="module")
def real_corpus(stdlib_cache_dir: Path) -> Corpus:
    return load_corpus(stdlib_cache_dir)


@pytest.fixture
def fake_stdlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny stand-in stdlib, so cache tests can rebuild it in milliseconds."""
    root = tmp_path / "stdlib"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    (root / "a.py").write_bytes(
        b"import os\n\ndef f(x):\n    return x + 1\n\nclass C:\n    y = 2\n"
    )
    (root / "pkg" / "b.py").write_bytes(b"@decorate\nasync def g():\n    await h()\n")
    (root / "broken.py").write_bytes(b"def (:\n")
    (root / "site-packages" / "third_party.py").write_bytes(b"def not_stdlib():\n    pass\n")
    monkeypatch.setattr(stdlib_corpus, "stdlib_root", lambda: root)
    return root


# --------------------------------------------------------------------------- extraction


def test_extract_definitions_exact_bytes_with_decorators_and_multibyte_text() -> None:
    source = (
        "# héllo\r\n"
        "x = 'ünïcode'\r\n"
        "@deco('é')\r\n"
        "@other\r\n"
        "def f(a='ß'):  # ok\r\n"
        "    return 'é'\r\n"
        "\r\n"
        "class K: v = '日本'\r\n"
    ).encode()
    definitions = extract_definitions(source)
    assert definitions == [
        "@deco('é')\r\n@other\r\ndef f(a='ß'):  # ok\r\n    return 'é'".encode(),
        "class K: v = '日本'".encode(),
    ]


def test_extract_definitions_reencodes_declared_encoding_as_utf8() -> None:
    source = "# -*- coding: latin-1 -*-\ndef f():\n    return 'café'\n".encode("latin-1")
    assert extract_definitions(source) == ["def f():\n    return 'café'".encode()]


# --------------------------------------------------------------------------- cache


def test_cache_round_trip_skips_parse(fake_stdlib: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    built = load_corpus(cache_dir)
    cached = load_corpus(cache_dir)
    assert not built.from_cache and cached.from_cache
    assert built.paths == cached.paths == ("a.py", "pkg/b.py")  # broken and site-packages left out
    np.testing.assert_array_equal(built.blob, cached.blob)
    np.testing.assert_array_equal(built.offsets, cached.offsets)
    np.testing.assert_array_equal(built.lengths, cached.lengths)
    np.testing.assert_array_equal(built.file_ids, cached.file_ids)
    samples = [
        bytes(cached.blob[o : o + n]) for o, n in zip(cached.offsets, cached.lengths, strict=True)
    ]
    assert samples == [
        b"def f(x):\n    return x + 1",
        b"class C:\n    y = 2",
        b"@decorate\nasync def g():\n    await h()",
    ]
    assert not [p for p in os.listdir(cache_dir) if p.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["flip_blob_byte", "truncate_blob", "garble_index"])
def test_corrupt_cache_is_rebuilt_with_one_warning(
    fake_stdlib: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cache_dir = tmp_path / "cache"
    good = load_corpus(cache_dir)
    blob_path = cache_dir / "code_lm_blob.npy"
    if damage == "flip_blob_byte":
        data = bytearray(blob_path.read_bytes())
        data[-1] ^= 0xFF
        blob_path.write_bytes(bytes(data))
    elif damage == "truncate_blob":
        blob_path.write_bytes(blob_path.read_bytes()[:-5])
    else:
        (cache_dir / "code_lm_index.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=stdlib_corpus.__name__):
        rebuilt = load_corpus(cache_dir)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage()
    assert not rebuilt.from_cache
    np.testing.assert_array_equal(rebuilt.blob, good.blob)
    assert load_corpus(cache_dir).from_cache  # the rebuilt cache is valid again


def test_changed_stdlib_invalidates_cache(
    fake_stdlib: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    load_corpus(cache_dir)
    (fake_stdlib / "new.py").write_bytes(b"def added():\n    pass\n")
    with caplog.at_level(logging.WARNING, logger=stdlib_corpus.__name__):
        corpus = load_corpus(cache_dir)
    assert not corpus.from_cache and "new.py" in corpus.paths
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1


# --------------------------------------------------------------------------- real corpus


def test_stdlib_corpus_stats(real_corpus: Corpus) -> None:
    stats = corpus_stats(real_corpus, max_seq_len=1024)
    assert stats["num_samples"] > 5000
    assert stats["num_files"] > 500
    assert 100 < stats["median_bytes"] < 2000
    assert stats["p99_bytes"] > 1024
    assert 0.05 < stats["fraction_at_cap"] < 0.9
    assert real_corpus.lengths.min() >= 2


def test_stdlib_cache_is_reused(stdlib_cache_dir: Path, real_corpus: Corpus) -> None:
    assert real_corpus.from_cache
    assert not any("site-packages" in p or "dist-packages" in p for p in real_corpus.paths)


def test_split_is_deterministic_and_disjoint_by_file(real_corpus: Corpus) -> None:
    train, validation = split_indices(real_corpus)
    train_again, validation_again = split_indices(real_corpus)
    np.testing.assert_array_equal(train, train_again)
    np.testing.assert_array_equal(validation, validation_again)
    assert len(np.intersect1d(train, validation)) == 0
    assert len(train) + len(validation) == real_corpus.num_samples
    train_files = set(real_corpus.file_ids[train].tolist())
    validation_files = set(real_corpus.file_ids[validation].tolist())
    assert train_files.isdisjoint(validation_files)
    held_out_share = len(validation_files) / (len(train_files) + len(validation_files))
    assert 0.02 < held_out_share < 0.10
    # The split is a function of the relative path alone.
    assert is_validation_file("json/decoder.py") == is_validation_file("json/decoder.py")


def test_datasets_truncate_and_report_lengths(stdlib_cache_dir: Path) -> None:
    task = build_code_lm_task(max_seq_len=64, cache_dir=stdlib_cache_dir, seed=0, **SMALL_MODEL)
    assert isinstance(task, Task)
    assert task.train_lengths.dtype == np.int64
    assert len(task.train_lengths) == len(task.train_set)
    assert task.train_lengths.max() == 64 and task.train_lengths.min() >= 2
    for index in (0, len(task.train_set) // 2, len(task.train_set) - 1):
        sample = task.train_set[index]
        assert sample.dtype == torch.uint8 and len(sample) == task.train_lengths[index]
    assert len(task.eval_set[0]) <= 64


# --------------------------------------------------------------------------- collate + model


def test_collate_counts_real_bytes_and_masks_padding() -> None:
    batch = collate_bytes(
        [
            torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8),
            torch.tensor([7, 8, 9], dtype=torch.uint8),
        ]
    )
    assert batch.inputs.dtype == torch.int64 and batch.inputs.shape == (2, 4)
    assert batch.num_samples == 2 and batch.num_tokens == 8
    assert batch.inputs.tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    assert batch.targets.tolist() == [[2, 3, 4, 5], [8, 9, IGNORE_INDEX, IGNORE_INDEX]]
    with pytest.raises(ValueError, match="2 bytes"):
        collate_bytes([torch.tensor([1], dtype=torch.uint8)])


def test_model_shape_and_padding_does_not_change_real_logits() -> None:
    torch.manual_seed(0)
    model = ByteTransformer(max_seq_len=32, **SMALL_MODEL).eval()
    short = torch.randint(0, 256, (10,), dtype=torch.uint8)
    long = torch.randint(0, 256, (25,), dtype=torch.uint8)
    alone = collate_bytes([short, short])
    padded = collate_bytes([short, long])
    with torch.no_grad():
        logits_alone = model(alone.inputs)
        logits_padded = model(padded.inputs)
    assert logits_padded.shape == (2, 24, 256)
    torch.testing.assert_close(logits_padded[0, :9], logits_alone[0], rtol=1e-5, atol=1e-5)


def test_build_model_is_deterministic_per_seed(stdlib_cache_dir: Path) -> None:
    def params(seed: int) -> list[torch.Tensor]:
        task = build_code_lm_task(
            max_seq_len=32, cache_dir=stdlib_cache_dir, seed=seed, **SMALL_MODEL
        )
        return list(task.build_model().state_dict().values())

    rng_before = torch.get_rng_state()
    first, second, other = params(3), params(3), params(4)
    assert torch.equal(rng_before, torch.get_rng_state())  # caller's RNG left alone
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_default_model_size(stdlib_cache_dir: Path) -> None:
    task = build_code_lm_task(
        max_seq_len=1024, d_model=128, num_layers=2, num_heads=4, cache_dir=stdlib_cache_dir, seed=0
    )
    model = task.build_model()
    assert 0.4e6 < sum(p.numel() for p in model.parameters()) < 0.7e6
    assert len(model.blocks) == 2


def test_losses_agree_and_training_reduces_loss(stdlib_cache_dir: Path) -> None:
    task = build_code_lm_task(max_seq_len=64, cache_dir=stdlib_cache_dir, seed=0, **SMALL_MODEL)
    model = task.build_model()
    batch = task.collate([task.train_set[i] for i in range(8)])
    loss = task.train_loss(model, batch)
    sums = task.eval_sums(model, batch)
    assert sums.count == batch.num_tokens - batch.num_samples  # one target per byte after the first
    assert sums.loss_sum / sums.count == pytest.approx(loss.item(), rel=1e-5)
    assert loss.item() == pytest.approx(np.log(256), rel=0.05)  # near-uniform at init
    # Overfitting one batch checks the loss is wired to the parameters, not the default lr.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(30):
        optimizer.zero_grad()
        task.train_loss(model, batch).backward()
        optimizer.step()
    assert task.train_loss(model, batch).item() < 0.7 * loss.item()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"max_seq_len": 8}, "max_seq_len=8"),
        ({"d_model": 30}, "d_model=30"),
        ({"num_layers": 0}, "num_layers=0"),
        ({"num_heads": 0}, "num_heads=0"),
    ],
)
def test_builder_rejects_bad_arguments(
    tmp_path: Path, override: dict[str, int], message: str
) -> None:
    arguments = {"max_seq_len": 64, **SMALL_MODEL, **override}
    with pytest.raises(ValueError, match=message):
        build_code_lm_task(cache_dir=tmp_path, seed=0, **arguments)


# --------------------------------------------------------------------------- digits


def test_digits_split_and_metadata() -> None:
    task = build_digits_task(seed=0)
    assert (len(task.train_set), len(task.eval_set)) == (1437, 360)
    assert task.train_lengths.dtype == np.int64 and (task.train_lengths == 1).all()
    test_labels = torch.stack([task.eval_set[i][1] for i in range(len(task.eval_set))])
    assert torch.bincount(test_labels, minlength=10).min() >= 34  # stratified
    image, _ = task.train_set[0]
    assert image.shape == (1, 8, 8) and 0.0 <= image.min() and image.max() <= 1.0
    batch = task.collate([task.train_set[i] for i in range(5)])
    assert batch.num_samples == batch.num_tokens == 5
    first, second = task.build_model(), build_digits_task(seed=0).build_model()
    assert all(
        torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True)
    )


def _tensors(split: tuple) -> list[torch.Tensor]:
    return [t for dataset in split for t in (dataset.images, dataset.labels)]


def test_digits_split_is_cached_and_a_bad_cache_is_computed_again(tmp_path: Path) -> None:
    computed = _tensors(load_digits_split())
    first = _tensors(load_digits_split(tmp_path))  # computes, then caches
    (cache,) = tmp_path.glob("digits-split-sklearn-*.npz")
    assert all(torch.equal(a, b) for a, b in zip(computed, first, strict=True))
    # a later worker start reads the cache without importing scikit-learn (the second it costs)
    code = ("import sys; from pathlib import Path; from poise.tasks.digits import load_digits_split; "
            f"load_digits_split(Path({str(tmp_path)!r})); print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
    good = cache.read_bytes()
    for bad in (b"garbage", good[: len(good) // 2], b"x" * (5 << 20)):
        cache.write_bytes(bad)
        again = _tensors(load_digits_split(tmp_path))
        assert all(torch.equal(a, b) for a, b in zip(computed, again, strict=True))
        assert cache.read_bytes() == good  # rewritten
    arrays = dict(np.load(cache))
    arrays["train_y"] = arrays["train_y"] + 10  # right shapes and types, labels out of range
    np.savez(cache, **arrays)
    assert all(torch.equal(a, b) for a, b in zip(computed, _tensors(load_digits_split(tmp_path)), strict=True))


def test_digits_training_reaches_95_percent() -> None:
    task = build_digits_task(seed=0)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.default_lr)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        indices = torch.randint(len(task.train_set), (64,), generator=generator).tolist()
        optimizer.zero_grad()
        task.train_loss(model, task.collate([task.train_set[i] for i in indices])).backward()
        optimizer.step()
    test_batch = task.collate([task.eval_set[i] for i in range(len(task.eval_set))])
    with torch.no_grad():
        sums = task.eval_sums(model, test_batch)
    assert sums.count == 360
    assert sums.correct / sums.count >= 0.95


def test_a_task_whose_package_is_missing_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """scikit-learn is an optional extra: ``--task digits`` without it fails before any worker starts,
    naming the package and how to install it (here a module that does not exist stands for it)."""
    from poise.tasks import registry

    registry.check_installed("digits")  # installed here
    monkeypatch.setitem(registry.NEEDS, "digits", ("poise_no_such_module", "scikit-learn"))
    with pytest.raises(ValueError, match=r"^task.name='digits' needs scikit-learn, which is not installed: "
                                         r"pip install scikit-learn \(or poise's 'tasks' extra\)$"):
        registry.check_installed("digits")
    registry.check_installed("code-lm")  # nothing beyond poise's own dependencies
