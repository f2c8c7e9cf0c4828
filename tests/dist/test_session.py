"""poise.Session on real gloo ranks: a user's own loop, through the public API only.

Exact gradients with unequal batches (with and without accumulation, with a codec), the
measurements and the files ``finish`` writes, state that resumes where it stopped, and the
one-line errors for misuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import poise
from poise.balance import make_sampler
from poise.diagnostics.timeline import column, load_table
from tests.harness import run_ranks

pytestmark = pytest.mark.dist

LENGTHS = np.random.default_rng(0).integers(2, 40, size=96)


class Sequences(Dataset):
    """Sample i: LENGTHS[i] random features in [0, 1) and a target per position."""

    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(i))
        return torch.rand(int(LENGTHS[i]), 4, generator=g), torch.rand(int(LENGTHS[i]), 1, generator=g)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(x) for x, _ in samples)
    x = torch.zeros(len(samples), longest, 4)
    y = torch.full((len(samples), longest, 1), float("nan"))  # padding: no loss term
    for k, (a, b) in enumerate(samples):
        x[k, : len(a)], y[k, : len(b)] = a, b
    return x, y


def token_mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real positions of the batch (one loss term per position)."""
    real = ~torch.isnan(y)
    return F.mse_loss(model(x)[real], y[real])


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _exact(rank: int, world_size: int, comm: str, accum_steps: int, balance: str = "cost") -> dict:
    budget = {"batch_size": 6} if balance == "auto" else {"batch_cost": world_size * 6 * 20.0}
    data = poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, accum_steps=accum_steps, dataset=Sequences(), **budget)
    session = poise.Session(_model(), data, balance=balance,
                            comm=poise.CommConfig(codec=comm, start_step=0, error_feedback=False))
    session.sampler.set_speeds([1.0, 3.0])  # rank 1 "three times faster": it gets about 3x the cost
    loader = session.dataloader(Sequences(), collate_fn=collate)
    out: dict = {"steps": [], "sizes": []}
    for step, (x, y) in session.steps(loader):
        step.backward(token_mean_loss(session.model, x, y))
        out["steps"].append([b.tolist() for b in session.sampler.global_batches(step.position)])
        out["sizes"].append(len(step.indices))
        if step.sync:
            out["grads"] = [p.grad.clone() for p in session.model.parameters()]
            break
    return out


@pytest.mark.parametrize(("comm", "accum_steps", "rtol", "balance"),
                         [("none", 1, 1e-5, "cost"), ("none", 2, 1e-5, "cost"), ("fp16", 1, 3e-3, "cost"),
                          ("none", 2, 1e-5, "auto")])
def test_unequal_batches_give_the_gradient_of_the_whole_step(comm, accum_steps, rtol, balance):
    """The gradient after step.backward equals a single process's gradient of the whole step's
    batch (with accumulation: the mean over the window's micro-steps of each one's); under
    ``auto`` the steps are plain DDP's own (the same samples) split by speed."""
    results = run_ranks(_exact, world_size=2, timeout_s=90, comm=comm, accum_steps=accum_steps, balance=balance)
    steps = results[0]["steps"]
    assert steps == results[1]["steps"]  # every rank planned the same steps
    assert any(len(a) != len(b) for a, b in steps)  # the batches really are unequal
    if balance == "auto":  # DDP's steps: the samples DistributedSampler gives plain DDP
        ddp = make_sampler("static", LENGTHS, rank=0, world_size=2, batch_size=6)
        assert [sorted(i for b in s for i in b) for s in steps] == \
            [sorted(np.concatenate(ddp.global_batches(j)).tolist()) for j in range(len(steps))]
    reference = _model()
    for batches in steps:
        everything = [i for b in batches for i in b]
        x, y = collate([Sequences()[i] for i in everything])
        (token_mean_loss(reference, x, y) / accum_steps).backward()
    for rank_result in results:
        for got, want in zip(rank_result["grads"], [p.grad for p in reference.parameters()], strict=True):
            torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)


def _train_and_finish(rank: int, world_size: int, out_dir: str, steps: int) -> dict | None:
    session = poise.Session(
        _model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4), comm="fp16", out_dir=out_dir,
        balance=poise.BalanceConfig(strategy="dynamic", cold_start_steps=3, replan_every_steps=20, window_steps=20),
        diagnostics=poise.DiagnosticsConfig(gather_every_steps=4, plot=True),
    )
    optimizer = torch.optim.SGD(session.model.parameters(), lr=0.05)
    loader = DataLoader(Sequences(), batch_sampler=session.sampler, collate_fn=collate)
    done, epoch = 0, 0
    while done < steps:
        session.sampler.set_epoch(epoch)
        for step, (x, y) in session.steps(loader):
            step.backward(token_mean_loss(session.model, x, y))
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break  # leaving the loop ends the open step
        epoch += 1
    return session.finish({"mine": "kept"})


def test_finish_writes_the_report_trace_and_plot_of_every_rank(tmp_path: Path):
    reports = run_ranks(_train_and_finish, world_size=2, timeout_s=120, out_dir=str(tmp_path), steps=30)
    assert reports[1] is None
    report = reports[0]
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "timeline.png").stat().st_size > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}
    assert report["steps"] == 30 and report["world_size"] == 2 and report["mine"] == "kept"
    knobs = {d["knob"]: d for d in report["decisions"]}  # every choice in force, said with its reason and pin
    assert knobs["balance"]["by"] == "you" and knobs["balance"]["pin"] == "balance='dynamic'"
    assert knobs["comm.codec"]["choice"] == "fp16" and knobs["sync"]["choice"] == "step"
    for key in ("balance", "idle_fraction", "comm_fraction", "throughput_tokens_per_s"):
        assert np.isfinite(report[key])
    assert [r["rank"] for r in report["per_rank"]] == [0, 1]
    assert all(r["median_compute_s"] > 0 for r in report["per_rank"])
    # each step's CPU: the rank's process since the last step ended covers its thread's forward and backward
    table = load_table(tmp_path / "timeline.npz")
    cpu, compute = column(table, "cpu_s"), column(table, "compute_cpu_s")
    assert np.all(compute > 0) and np.all(cpu >= compute - 0.002)
    # plain steps: the wall seconds beside it are forward + backward's own (until the last bucket was handed over)
    assert np.allclose(column(table, "compute_wall_s"), column(table, "compute_s"))
    assert all(0 < r["cpus_busy"] for r in report["per_rank"])  # CPUs each rank's process kept busy
    assert all(0 < r["compute_on_cpu"] <= 1 for r in report["per_rank"])
    # the codec's hook saw the gradients: fp16 halves the bytes
    assert report["comm_raw_bytes_per_step"] > 0
    assert report["compression_ratio"] == pytest.approx(2.0, rel=0.05)
    # the re-planner ran at steps 3 and 23, every rank agreeing
    assert [e["step"] for e in report["replans"]] == [3, 23]
    assert all(sum(e["shares"]) == pytest.approx(1.0) for e in report["replans"])


def _codec_decided(rank: int, world_size: int) -> list[dict | None]:
    """Two sessions naming no codec, one after the other on the same ranks: torchrun's
    LOCAL_WORLD_SIZE says all ranks share one node, then that each rank is a node of its own."""
    import os

    reports = []
    for ranks_per_node in (world_size, 1):
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
        session = poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4, total_steps=8))
        optimizer = torch.optim.SGD(session.model.parameters(), lr=0.05)
        loader = DataLoader(Sequences(), batch_sampler=session.sampler, collate_fn=collate)
        for done, (step, (x, y)) in enumerate(session.steps(loader), 1):
            step.backward(token_mean_loss(session.model, x, y))
            optimizer.step()
            optimizer.zero_grad()
            if done == 8:
                break
        reports.append(session.finish())
    return reports


def test_with_no_codec_named_one_node_sends_exact_gradients_and_several_nodes_try_powersgd():
    one_node, nodes = run_ranks(_codec_decided, world_size=2, timeout_s=120)[0]
    assert one_node["codec"] == "none" and one_node["codec_by_poise"].startswith("one node")
    assert one_node["codec_trial"] is None  # no trial, no dry run: DDP's exact all-reduce
    assert nodes["codec"] == "auto" and nodes["codec_by_poise"].startswith("several nodes")
    trial = nodes["codec_trial"]
    assert trial["start_step"] == 5 and trial["uses_codec"] in (True, False)  # decided after its dry runs
    for report, choice in ((one_node, "none (exact)"), (nodes, "powersgd" if trial["uses_codec"] else "none (exact)")):
        codec = [d for d in report["decisions"] if d["knob"] == "comm.codec"]
        assert codec[0]["choice"] == choice and codec[0]["by"] == "poise", codec


def _resume(rank: int, world_size: int, prefetch: int, plan: str) -> dict:
    """Train 5 steps with the DataLoader ``prefetch`` batches ahead, save, and resume in a new
    session: the steps after the save are the ones an uninterrupted run trains. The shares
    move at steps 3 and 7 by a replayed plan (``plan``), one before the save and one after it:
    re-plans from measured speeds would differ between the runs on a loaded machine."""
    def session() -> poise.Session:
        return poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4),
                             balance=poise.BalanceConfig(strategy="dynamic", replay=plan),
                             comm=poise.CommConfig(codec="topk", start_step=0))

    def batches(s: poise.Session, count: int) -> list[list[int]]:
        seen = []
        loader = iter(DataLoader(Sequences(), batch_sampler=s.sampler, collate_fn=collate))
        ahead = [next(loader) for _ in range(prefetch + 1)]  # a DataLoader with workers asks ahead like this
        for _ in range(count):
            x, y = ahead.pop(0)
            with s.step() as step:
                step.backward(token_mean_loss(s.model, x, y))
                seen.append(step.indices.tolist())
            ahead.append(next(loader))
        return seen

    whole = batches(session(), 9)
    first = session()
    batches(first, 5)
    saved = first.state_dict()
    saved = torch.load(_roundtrip(saved, rank), weights_only=True)
    second = session()
    second.load_state_dict(saved)
    return {"whole": whole[5:], "resumed": batches(second, 4), "residuals": bool(saved["comm"])}


def _roundtrip(state: dict, rank: int):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_saved_session_resumes_at_the_first_batch_not_trained(prefetch, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"step": 3, "shares": [0.7, 0.3]}, {"step": 7, "shares": [0.4, 0.6]}]))
    for result in run_ranks(_resume, world_size=2, timeout_s=90, prefetch=prefetch, plan=str(plan)):
        assert result["resumed"] == result["whole"]
        assert result["residuals"]


def _resume_from_rank_0(rank: int, world_size: int) -> list[float]:
    """Every rank loads the state rank 0 saved (a framework that checkpoints on rank 0 only),
    with a codec already compressing: the ranks must agree on its step, or gloo gets
    collectives of different sizes."""
    def session() -> poise.Session:
        return poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4),
                             comm=poise.CommConfig(codec="topk", start_step=3))

    def train(s: poise.Session, steps: int) -> list[float]:
        losses = []
        for step, (x, y) in s.steps(DataLoader(Sequences(), batch_sampler=s.sampler, collate_fn=collate)):
            loss = token_mean_loss(s.model, x, y)
            step.backward(loss)
            losses.append(float(loss))
            if len(losses) == steps:
                break
        return losses

    first = session()
    train(first, 5)  # compressing since step 3
    states: list = [None]
    if rank == 0:
        states[0] = first.state_dict()
    torch.distributed.broadcast_object_list(states, src=0)
    second = session()
    second.load_state_dict(states[0])
    return train(second, 4)


def test_a_state_saved_by_rank_0_resumes_on_every_rank_with_a_codec():
    for losses in run_ranks(_resume_from_rank_0, world_size=2, timeout_s=60):
        assert len(losses) == 4 and all(np.isfinite(losses))


def _misuse(rank: int, world_size: int) -> dict:
    errors = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as exc:
            errors[name] = str(exc)

    catch("keyword", lambda: poise.Session.from_kwargs(_model(), lengths=LENGTHS, batch_size=4, rank=1 - rank))
    catch("accum", lambda: poise.Data(lengths=LENGTHS, batch_size=4, accum_steps=0))
    catch("dataset", lambda: poise.Session(_model(), poise.Data(lengths=LENGTHS[:10], batch_size=4,
                                                                dataset=Sequences())))
    sampler = make_sampler("cost", LENGTHS, rank=0, world_size=1, batch_size=4)
    catch("sampler", lambda: poise.Session(_model(), poise.Data(sampler=sampler)))
    session = poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4))
    catch("no batch", session.step)
    other = DataLoader(Sequences(), batch_size=4, collate_fn=collate)
    for _ in other:  # a loader that does not use the session's sampler
        catch("foreign loader", session.step)
        break
    loader = iter(session.dataloader(Sequences(), collate_fn=collate))
    x, y = next(loader)
    step = session.step()
    catch("no backward", step.end)
    x, y = next(loader)
    with session.step() as step:
        step.backward(token_mean_loss(session.model, x, y))
        catch("twice", lambda: step.backward(token_mean_loss(session.model, x, y)))
    catch("after end", lambda: step.backward(token_mean_loss(session.model, x, y)))
    catch("load", lambda: session.load_state_dict({"epoch": 0}))
    x, y = next(loader)
    step = session.step()
    weights = [p.detach().clone() for p in session.model.parameters()]
    # not through step.backward: refused as its first bucket is reduced, before any optimizer step
    catch("plain backward", lambda: token_mean_loss(session.model, x, y).backward())
    unchanged = all(torch.equal(a, b) for a, b in zip(weights, session.model.parameters(), strict=True))
    return {**errors, "weights": "unchanged" if unchanged else "changed"}


def test_misuse_gets_one_line_naming_what_is_expected():
    for rank, errors in enumerate(run_ranks(_misuse, world_size=2, timeout_s=90)):
        assert errors["keyword"].startswith("session keyword(s) rank (now nothing: the rank is the process group's)")
        assert errors["accum"] == "accum_steps=0 must be >= 1"
        assert errors["dataset"] == "the dataset has 96 samples but lengths has 10"
        assert errors["sampler"] == (f"the sampler was made for rank 0 of 1, but this process is rank {rank} of 2")
        for key in ("no batch", "foreign loader"):
            assert "give your DataLoader batch_sampler=session.sampler" in errors[key]
        assert "call step.backward(loss), not loss.backward()" in errors["plain backward"]
        assert errors.pop("weights") == "unchanged"
        assert errors["no backward"].endswith("ended without step.backward(loss): no backward ran")
        assert "called twice" in errors["twice"]
        assert "which has ended" in errors["after end"]
        assert "not a poise session state" in errors["load"]
        assert all("\n" not in e for e in errors.values())


def _own_static_sampler(rank: int, world_size: int, out_dir: str) -> dict | None:
    sampler = poise.balance.make_sampler("static", LENGTHS, rank=rank, world_size=world_size, batch_size=4)
    session = poise.Session(_model(), poise.Data(sampler=sampler), out_dir=out_dir,
                            diagnostics=poise.DiagnosticsConfig(plot=False))
    for n, (step, (x, y)) in enumerate(session.steps(DataLoader(Sequences(), batch_sampler=session.sampler,
                                                                collate_fn=collate))):
        step.backward(token_mean_loss(session.model, x, y))
        if n == 2:
            break
    return session.finish()


def test_a_sampler_of_the_users_is_not_said_to_be_autos_split(tmp_path: Path):
    """No balance setting (auto) with Data(sampler=StaticSchedule): the sampler's split trains,
    nothing re-plans it, and the report's decision names the user's sampler."""
    report = run_ranks(_own_static_sampler, world_size=2, timeout_s=60, out_dir=str(tmp_path))[0]
    assert report["balance_strategy"] == "auto" and not report.get("replans")
    assert report["balance_sampler"] == {"type": "StaticSchedule", "replanned": False}
    split = next(d for d in report["decisions"] if d["knob"] == "balance")
    assert split["by"] == "you" and split["choice"].startswith("your StaticSchedule")
