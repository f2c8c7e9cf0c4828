"""The comparison baselines as synchronization strategies, on real gloo ranks: torch's
post-local SGD (``TorchLocalSGD``) and torchft's DiLoCo (``TorchftDiLoCo``), driven at the
strategy's call points as a step drives them.

Each rank trains on data of its own, so replicas that are not synchronized drift apart: equal
parameters right after an average are the average's doing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from poise.config import CommConfig
from poise.config.sync import SyncConfig
from poise.runtime.clock import HostClock
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def _drive(sync: Any, steps: int, rank: int, lr: float = 0.1) -> list[dict[str, Any]]:
    """``steps`` optimizer steps through ``sync``'s call points; after each, the parameters and traffic."""
    opt = torch.optim.SGD(sync.model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i in range(steps):
        x = torch.randn(8, 4, generator=g) + rank
        y = torch.randn(8, 1, generator=g) * (rank + 1)
        sync.begin_step(i)
        sync.micro_batch(True)
        opt.zero_grad()
        loss = nn.functional.mse_loss(sync.model(x), y)
        sync.backward(loss.backward)
        opt.step()
        opt.zero_grad(set_to_none=True)  # as poise train's loop does before the step ends
        sync.end_step(i, tokens=8.0, optimizer_step=True)
        stats, inter = sync.traffic()
        out.append({"params": _params(sync.model), "wire": stats.wire_bytes, "inter": inter.wire_bytes})
    return out


def _localsgd(rank: int, world_size: int, inner_steps: int, warmup: int, steps: int) -> dict[str, Any]:
    from poise.sync.torch_localsgd import TorchLocalSGD

    refused = []
    for comm, per_node in ((CommConfig(codec="fp16"), 1), (CommConfig(), 3)):
        try:
            TorchLocalSGD(_model(), comm, SyncConfig(mode="torch-localsgd"), clock=HostClock(), backend="gloo",
                          compression_start=1, ranks_per_node=per_node)
        except ValueError as exc:
            refused.append(str(exc))
    sync = TorchLocalSGD(_model(), CommConfig(), SyncConfig(mode="torch-localsgd", inner_steps=inner_steps),
                         clock=HostClock(), backend="gloo", compression_start=warmup,
                         ranks_per_node=1)  # each rank a node of its own
    records = _drive(sync, steps, rank)
    return {"records": records, "refused": refused, "summary": sync.summary(), "state": sync.state_dict(),
            "param_bytes": sum(p.numel() * 4 for p in sync.model.parameters())}


@pytest.mark.timeout(120)
def test_torch_localsgd_period_one_keeps_replicas_equal() -> None:
    a, b = run_ranks(_localsgd, 2, timeout_s=90, inner_steps=1, warmup=2, steps=6)
    for i, (ra, rb) in enumerate(zip(a["records"], b["records"], strict=True)):
        assert torch.equal(ra["params"], rb["params"]), f"step {i}: the replicas differ"
    assert a["summary"]["outer_steps"] == 4  # every step after the 2 warm-up steps
    assert "comm.codec='fp16'" in a["refused"][0] and "3 ranks per node" in a["refused"][1]


@pytest.mark.timeout(120)
def test_torch_localsgd_averages_every_h_steps() -> None:
    warmup, h, steps = 2, 3, 9
    a, b = run_ranks(_localsgd, 2, timeout_s=90, inner_steps=h, warmup=warmup, steps=steps)
    param_bytes = a["param_bytes"]
    for i, (ra, rb) in enumerate(zip(a["records"], b["records"], strict=True)):
        averaged = i >= warmup and (i - warmup) % h == 0
        if i < warmup:  # plain DDP: the gradients are all-reduced over the world, every byte crosses nodes
            assert torch.equal(ra["params"], rb["params"]), f"warm-up step {i}: the replicas differ"
            assert ra["wire"] == ra["inter"] == param_bytes  # one gradient per parameter
        elif averaged:  # local step, then the averager: equal right after
            assert torch.equal(ra["params"], rb["params"]), f"step {i}: the average left the replicas different"
            assert ra["wire"] == ra["inter"] == param_bytes  # the parameters; the gradient stayed on its node
        else:  # local steps: each node its own, nothing sent
            assert not torch.allclose(ra["params"], rb["params"]), f"step {i}: replicas equal between averages"
            assert ra["wire"] == ra["inter"] == 0
    assert a["summary"]["outer_steps"] == 3  # steps 2, 5, 8
    # torch's hook counts iterations only until local SGD starts; the averager counts every step
    assert a["state"] == {"iter": warmup, "averager_step": steps, "averages": 3}


def _torchft(rank: int, world_size: int, inner_steps: int, steps: int) -> dict[str, Any]:
    from poise.sync.torchft_diloco import TorchftDiLoCo

    common = {"clock": HostClock(), "backend": "gloo", "compression_start": 2}
    refused = []
    for comm, sync_config in ((CommConfig(), SyncConfig(mode="torchft-diloco", codec="int8")),
                              (CommConfig(codec="fp16"), SyncConfig(mode="torchft-diloco"))):
        try:
            TorchftDiLoCo(_model(), comm, sync_config, **common)
        except ValueError as exc:
            refused.append(str(exc))
    model = _model()
    with torch.no_grad():  # replicas that start apart: only rank 0's broadcast makes them equal
        for p in model.parameters():
            p.add_(rank)
    sync = TorchftDiLoCo(model, CommConfig(), SyncConfig(mode="torchft-diloco", inner_steps=inner_steps),
                         ranks_per_node=1, **common)
    start = _params(sync.model)
    # the local parameters before each outer step: the step they take is checked against them
    opt = torch.optim.SGD(sync.model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for i in range(steps):
        x = torch.randn(8, 4, generator=g) + rank
        sync.begin_step(i)
        sync.micro_batch(True)
        opt.zero_grad()
        loss = sync.model(x).pow(2).mean()
        sync.backward(loss.backward)
        opt.step()
        local = _params(sync.model)
        sync.end_step(i, tokens=8.0, optimizer_step=True)
        stats, inter = sync.traffic()
        records.append({"local": local, "params": _params(sync.model), "wire": stats.wire_bytes,
                        "inter": inter.wire_bytes})
    summary = sync.summary()
    state = sync.state_dict()
    sync.close()
    dist.barrier()
    return {"start": start, "records": records, "summary": summary, "refused": refused,
            "momentum_keys": len(state["outer_optimizer"]["state"]),
            "param_bytes": sum(p.numel() * 4 for p in sync.model.parameters())}


@pytest.mark.timeout(150)
def test_torchft_diloco_two_ranks() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"torchft is not installed (pip install 'poise[bench]'): {type(exc).__name__}: {exc}")
    h, steps = 2, 4
    a, b = run_ranks(_torchft, 2, timeout_s=120, inner_steps=h, steps=steps)
    assert "sync.codec='int8'" in a["refused"][0] and "comm.codec='fp16'" in a["refused"][1]
    assert torch.equal(a["start"], b["start"])  # rank 0's parameters broadcast at the start
    global_params = a["start"]
    for i, (ra, rb) in enumerate(zip(a["records"], b["records"], strict=True)):
        if (i + 1) % h:  # inner steps: nothing sent, each replica its own
            assert not torch.allclose(ra["params"], rb["params"]), f"step {i}: replicas equal between outer steps"
            assert ra["wire"] == 0
            continue
        assert torch.equal(ra["params"], rb["params"]), f"step {i}: the outer step left the replicas different"
        assert ra["wire"] == ra["inter"] == a["param_bytes"]
        # the outer Nesterov SGD (lr 0.7, momentum 0.9) on the replicas' mean parameter change
        delta = global_params - (ra["local"] + rb["local"]) / 2
        if i + 1 == h:  # the first outer step: the momentum buffer is the change itself
            expected = global_params - 0.7 * (1 + 0.9) * delta
            torch.testing.assert_close(ra["params"], expected, rtol=1e-5, atol=1e-6)
        global_params = ra["params"]
    assert a["summary"]["outer_steps"] == steps // h and a["summary"]["torchft_step"] == steps // h
    assert a["momentum_keys"] == 4  # the outer optimizer's momentum, one buffer per parameter


def _equivalent(rank: int, world_size: int, mode: str, steps: int) -> torch.Tensor:
    """``steps`` steps of AdamW through torchft's DiLoCo or poise's (equal weighting): the parameters."""
    from poise.sync.outer import Outer
    from poise.sync.torchft_diloco import TorchftDiLoCo

    common = {"clock": HostClock(), "backend": "gloo", "compression_start": 2}
    config = SyncConfig(mode=mode, inner_steps=2, weighting="equal")
    sync = (TorchftDiLoCo(_model(), CommConfig(), config, ranks_per_node=1, **common) if mode == "torchft-diloco"
            else Outer(_model(), CommConfig(), config, world_size=world_size, last_step=steps, **common))
    opt = torch.optim.AdamW(sync.model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(steps):
        x, tokens = torch.randn(4 + 4 * rank, 4, generator=g) + rank, 4.0 + 4 * rank  # unequal batches
        sync.begin_step(i)
        sync.micro_batch(True)
        loss = sync.model(x).pow(2).mean()
        sync.backward(loss.backward)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.end_step(i, tokens=tokens, optimizer_step=True)
    params = _params(sync.model)
    if isinstance(sync, TorchftDiLoCo):
        sync.close()
    dist.barrier()
    return params


@pytest.mark.timeout(150)
def test_poise_diloco_with_equal_weighting_is_torchft_diloco() -> None:
    # the bench's faithful equivalent: the same outer Nesterov step on the equally weighted change
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"torchft is not installed (pip install 'poise[bench]'): {type(exc).__name__}: {exc}")
    theirs = run_ranks(_equivalent, 2, timeout_s=120, mode="torchft-diloco", steps=6)
    ours = run_ranks(_equivalent, 2, timeout_s=120, mode="diloco", steps=6)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[0], ours[1])  # replicas equal after the last outer step (step 6)
