"""FSDP2 through the Accelerate and Lightning adapters, end to end: each job on 2 gloo
processes under torch's launcher with the real framework, a cost-balanced sampler (the ranks'
batches differ in size and loss terms) and SGD. Each run's final parameters are checked
against one process replaying the same steps on the union of both ranks' batches, and
against ``poise.Session`` on the same ``fully_shard`` model without any framework."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.e2e.scripts import toy
from tests.harness import run_cli, run_ranks

pytestmark = pytest.mark.e2e

SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
TIMEOUT_S = 120
LR = 0.05  # the scripts' SGD learning rate


def _launch(script: str, out: Path, *args: str) -> None:
    """Run ``script`` on 2 ranks (bounded), its outputs in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ACCELERATE_USE_FSDP", None)
    proc = run_cli(["--nproc-per-node", "2", "--standalone", str(SCRIPTS / script), "--out", str(out), *args],
                   cwd=ROOT, env=env, timeout_s=TIMEOUT_S, program="torchrun")
    assert proc.returncode == 0, proc.stderr[-4000:]


def _saved(out: Path) -> list[dict]:
    return [torch.load(out / f"fsdp_rank{rank}.pt") for rank in (0, 1)]


def _replay(saved: list[dict], accumulate: int, weighted: bool = True) -> dict[str, torch.Tensor]:
    """One process, the same steps: per micro-batch the mean loss over both ranks' batches
    together (``weighted``; else the plain mean of the two ranks' mean losses, what an
    unweighted average of their gradients gives), divided by the accumulation, and an SGD
    step where the run stepped."""
    seqs, model = toy.make_sequences(), toy.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def loss(indices: list[int]) -> torch.Tensor:
        return toy.mean_loss(model, toy.collate([(i, seqs[i]) for i in indices]))

    first, second = saved
    for a, b, sync in zip(first["batches"], second["batches"], first["syncs"], strict=True):
        total = loss(a + b) if weighted else (loss(a) + loss(b)) / 2
        (total / accumulate).backward()
        if sync:
            optimizer.step()
            optimizer.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


def _check_run(out: Path, accumulate: int, *, rtol: float, atol: float) -> list[dict]:
    """Both ranks end with one model, that of the single-process replay (and not that of the
    unweighted average: the ranks' loss terms differ, so the weighting is what is tested)."""
    saved = _saved(out)
    first, second = saved
    assert first["syncs"] == second["syncs"] and first["syncs"][-1]
    terms = toy.lengths_and_terms(toy.make_sequences())[1]
    assert any(terms[a].sum() != terms[b].sum() for a, b in zip(first["batches"], second["batches"], strict=True))
    for name, value in first["params"].items():
        assert torch.equal(value, second["params"][name]), name
    expected, naive = _replay(saved, accumulate), _replay(saved, accumulate, weighted=False)
    for name, value in expected.items():
        torch.testing.assert_close(first["params"][name], value, rtol=rtol, atol=atol)
    error = max(float((first["params"][n] - expected[n]).abs().max()) for n in expected)
    assert max(float((naive[n] - expected[n]).abs().max()) for n in expected) > 10 * max(error, 1e-7)
    initial = {name: p.detach() for name, p in toy.make_model().named_parameters()}
    assert max(float((expected[n] - initial[n]).abs().max()) for n in expected) > 1e-3  # it trained
    return saved


@pytest.fixture(scope="module")
def session_run(tmp_path_factory) -> list[dict]:
    """poise.Session on the toy model sharded with fully_shard, no framework: 5 steps."""
    out = tmp_path_factory.mktemp("session")
    _launch("accelerate_fsdp_train.py", out, "--mode", "session")
    return _check_run(out, 1, rtol=1e-5, atol=1e-6)


def _same_as_session(saved: list[dict], session_run: list[dict]) -> None:
    assert saved[0]["batches"] == session_run[0]["batches"] and saved[1]["batches"] == session_run[1]["batches"]
    for name, value in session_run[0]["params"].items():
        torch.testing.assert_close(saved[0]["params"][name], value, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
def test_accelerate_fsdp2_prepared(tmp_path, session_run):
    """Accelerate's FSDP2 plugin shards the model in prepare(); attach() trains it exactly."""
    _launch("accelerate_fsdp_train.py", tmp_path, "--mode", "prepare")
    saved = _check_run(tmp_path, 1, rtol=1e-5, atol=1e-6)
    _same_as_session(saved, session_run)
    assert saved[0]["distributed_type"] == "FSDP" and saved[0]["model_type"] == "FSDPTinyLM"
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == 5 and report["accelerate"]["distributed_type"] == "FSDP"
    assert report["sync"]["mode"] == "fsdp" and report["sync"]["shard_size"] == 2


@pytest.mark.timeout(300)
def test_accelerate_own_fully_shard_fp16_accumulating(tmp_path):
    """On CPU (MULTI_CPU): the user's fully_shard model, the optimizer alone prepared, the fp16
    codec on the reduce-scatter and 2 micro-batches per step."""
    _launch("accelerate_fsdp_train.py", tmp_path, "--mode", "own", "--comm", "fp16", "--accumulate", "2",
            "--steps", "3")
    # fp16 gradient shards on the wire: each SGD step off by lr x |g| x 2^-11 at most (about 1e-6 here)
    saved = _check_run(tmp_path, 2, rtol=0.0, atol=5e-6)
    assert saved[0]["distributed_type"] == "MULTI_CPU" and saved[0]["syncs"] == [False, True] * 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["codec"] == "fp16" and report["sync"]["codec_on"] == "reduce-scatter"
    assert 0 < report["comm_wire_bytes_per_step"] < report["comm_raw_bytes_per_step"]


@pytest.mark.timeout(300)
def test_accelerate_refusals(tmp_path):
    """What attach() refuses, each in one line naming what runs; and Accelerate 1.15 on CPU
    keeps MULTI_CPU (DDP) though an FSDP plugin is given."""
    _launch("accelerate_fsdp_train.py", tmp_path, "--mode", "refusals")
    refused = json.loads((tmp_path / "refused.json").read_text())
    assert refused["distributed_type_with_plugin"] == "MULTI_CPU"
    assert "prepared DDP" in refused["plugin_dropped_on_cpu"] and "fully_shard" in refused["plugin_dropped_on_cpu"]
    assert "FSDP version 1" in refused["fsdp1"] and "fsdp_version=2" in refused["fsdp1"]
    assert "not the FSDP2 module" in refused["fsdp2_not_prepared"]
    assert refused["deepspeed"].startswith("attach(): Accelerate runs DEEPSPEED") and "FSDP2" in refused["deepspeed"]
    assert all("\n" not in message for message in refused.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_fsdp2(tmp_path, accumulate, session_run):
    """PoiseFSDPStrategy on the model configure_model shards; with accumulation the run goes
    into a second epoch (7 micro-batches an epoch, the last of each one stepping alone)."""
    _launch("lightning_fsdp_train.py", tmp_path, "--accumulate", str(accumulate), "--save-every", "3")
    saved = _check_run(tmp_path, accumulate, rtol=1e-5, atol=1e-6)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["lightning"]["global_step"] == 5 and report["sync"]["mode"] == "fsdp"
    assert saved[0]["model_type"] == "FSDPTinyLM"
    if accumulate == 1:
        _same_as_session(saved, session_run)
        assert report["steps"] == 5
    else:
        assert report["steps"] == 9 and report["lightning"]["epochs"] == 2
        assert saved[0]["syncs"] == [False, True] * 3 + [True] + [False, True]
    # Lightning's sharded checkpoint (a folder: each rank's shard and meta.pt) holds rank 0's session state
    meta = torch.load(tmp_path / "every" / "epoch=0-step=3.ckpt" / "meta.pt", weights_only=False)
    assert meta["poise"]["world_size"] == 2 and meta["poise"]["steps_done"] == 3 * accumulate
    if accumulate == 1:  # continued from step 3 (mid-epoch): the same batches and parameters, bit for bit
        resumed = tmp_path / "resumed"
        _launch("lightning_fsdp_train.py", resumed, "--resume", str(tmp_path / "every" / "epoch=0-step=3.ckpt"))
        again = _saved(resumed)
        for rank in (0, 1):
            assert again[rank]["batches"] == saved[rank]["batches"][3:]
        for name, value in saved[0]["params"].items():
            assert torch.equal(again[0]["params"][name], value), name


def _sharded_model_refusals(rank: int, world_size: int) -> dict[str, str]:
    """PoiseFSDPStrategy's model lookup on LightningModules sharded in ways it refuses."""
    import lightning.pytorch as pl
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from poise.integrations.lightning import _sharded_model

    class Two(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    out: dict[str, str] = {}

    def refused(case: str, module: pl.LightningModule) -> None:
        try:
            _sharded_model(module)
        except ValueError as e:
            out[case] = str(e)

    refused("none", Two())
    both = Two()
    fully_shard(both.a)
    fully_shard(both.b)
    refused("two", both)
    outside = Two()
    fully_shard(outside.a)
    refused("outside", outside)
    whole = Two()
    fully_shard(whole)
    refused("whole", whole)
    good = Two()
    good.b.requires_grad_(False)  # frozen parameters may stay outside
    fully_shard(good.a)
    assert _sharded_model(good) is good.a
    return out


@pytest.mark.timeout(120)
def test_lightning_fsdp_refusals():
    out = run_ranks(_sharded_model_refusals, 2, timeout_s=90)[0]
    assert "found none" in out["none"] and "found a, b" in out["two"]
    assert "'b.weight' is outside the sharded model 'a'" in out["outside"]
    assert "not the LightningModule" in out["whole"]
    from poise.integrations.lightning import PoiseFSDPStrategy
    with pytest.raises(ValueError, match="runs every rank data-parallel"):
        PoiseFSDPStrategy(lengths=[1, 2], batch_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="sets accum_steps"):
        PoiseFSDPStrategy(lengths=[1, 2], batch_size=2, accum_steps=2)
