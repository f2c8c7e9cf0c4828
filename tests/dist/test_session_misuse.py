"""The mistakes a user of poise.Session is likely to make, on real gloo ranks: each refused in
one line before anything is trained wrongly, or made impossible, and the ways to be exact and
reproducible without guessing (counted loss terms, a replayed plan)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import poise
from tests.dist.test_session import LENGTHS, Sequences, _model, collate, token_mean_loss
from tests.harness import run_ranks

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def _real_terms(y: torch.Tensor) -> torch.Tensor:
    return (~torch.isnan(y)).sum()


def _counted(rank: int, world_size: int) -> dict:
    """One step weighted by the terms counted in the batch in hand (num_items), while
    Data.loss_terms is left at its default (one per sample: wrong for this loss)."""
    session = poise.Session(_model(), poise.Data(lengths=LENGTHS, batch_size=6), balance="cost")
    loader = session.dataloader(Sequences(), collate_fn=collate)
    for step, (x, y) in session.steps(loader):
        step.backward(token_mean_loss(session.model, x, y), num_items=_real_terms(y))
        grads = [p.grad.clone() for p in session.model.parameters()]
        batches = session.sampler.global_batches(step.position)
        break
    return {"grads": grads, "batches": [b.tolist() for b in batches]}


def test_counted_loss_terms_give_the_exact_gradient_whatever_loss_terms_say():
    results = run_ranks(_counted, world_size=2, timeout_s=60)
    union = [i for b in results[0]["batches"] for i in b]
    reference = _model()
    x, y = collate([Sequences()[i] for i in union])
    token_mean_loss(reference, x, y).backward()
    for got in (results[0]["grads"], results[1]["grads"]):
        for g, p in zip(got, reference.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def _misuse(rank: int, world_size: int, tmp: str) -> dict:
    errors: dict[str, str] = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as exc:
            errors[name] = str(exc)

    # a lossy codec without the run's length would compress from step 2
    catch("lossy", lambda: poise.Session(_model(), poise.Data(lengths=LENGTHS, batch_size=4), comm="powersgd"))
    session = poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4))
    # the examples' own pattern with a dataset of another length: refused before the first step
    short = torch.utils.data.Subset(Sequences(), range(len(LENGTHS) - 10))
    catch("length", lambda: next(iter(session.steps(DataLoader(short, batch_sampler=session.sampler,
                                                               collate_fn=collate)))))
    # the batch sampler wrapped (as accelerator.prepare does): the batch in hand would not be the weighted one
    from accelerate.data_loader import BatchSamplerShard

    sharded = DataLoader(Sequences(), batch_sampler=BatchSamplerShard(session.sampler, num_processes=2,
                                                                     process_index=rank), collate_fn=collate)
    catch("wrapped", lambda: next(iter(session.steps(sharded))))
    return errors


def test_misuse_is_refused_before_a_step_trains(tmp_path):
    for errors in run_ranks(_misuse, world_size=2, timeout_s=60, tmp=str(tmp_path)):
        assert errors["lossy"].startswith("comm.codec='powersgd' is lossy: it starts compressing after a twentieth")
        assert errors["length"] == "the dataset has 86 samples but lengths has 96"
        assert "it batches with a BatchSamplerShard around it (accelerator.prepare(loader)?)" in errors["wrapped"]


def _resume(rank: int, world_size: int, accum_steps: int, stop_after: int, tmp: str) -> dict:
    """Steps of an accumulating run, saving state inside the loop after the optimizer step (the
    natural place), then a second session resumed from it: which micro-batches end windows."""
    def session() -> poise.Session:
        data = poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4, accum_steps=accum_steps)
        return poise.Session(_model(), data)

    first = session()
    syncs, state = [], None
    for k, (step, (x, y)) in enumerate(first.steps(first.dataloader(Sequences(), collate_fn=collate))):
        step.backward(token_mean_loss(first.model, x, y))
        syncs.append((step.index, step.sync))
        if k + 1 == stop_after:
            state = first.state_dict()  # inside the step, after its backward (and optimizer step)
            break
    second = session()
    second.load_state_dict(state)
    resumed = []
    for k, (step, (x, y)) in enumerate(second.steps(second.dataloader(Sequences(), collate_fn=collate))):
        step.backward(token_mean_loss(second.model, x, y))
        resumed.append((step.index, step.sync, step.position))
        if k == 3:
            break
    return {"syncs": syncs, "resumed": resumed, "saved_steps": state["steps_done"]}


def test_state_saved_inside_the_loop_keeps_accumulation_windows():
    for result in run_ranks(_resume, world_size=2, timeout_s=60, accum_steps=2, stop_after=3, tmp=""):
        assert result["saved_steps"] == 3  # the open step, whose backward ran, counts as done
        # the resumed run continues with micro-batch 3: the second half of a window, then a new one
        assert [(i, s) for i, s, _ in result["resumed"]] == [(3, True), (4, False), (5, True), (6, False)]
        assert result["resumed"][0][2] == 3  # and with the batch after the last one trained


def _wide_model() -> torch.nn.Module:
    torch.manual_seed(0)  # wide enough that a step's compute (ms) stands out of gloo's noise
    return torch.nn.Sequential(torch.nn.Linear(4, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, 1))


def _replay(rank: int, world_size: int, tmp: str, replay: str) -> list[list[int]]:
    balance = poise.BalanceConfig(strategy="dynamic", cold_start_steps=4, replan_every_steps=2, replay=replay)
    emulate = None if replay else poise.EmulateConfig(rank_speed="1:0.25", slowdown_method="sleep")
    session = poise.Session(_wide_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=16),
                            balance=balance, emulate=emulate)
    seen = []
    for k, (step, (x, y)) in enumerate(session.steps(session.dataloader(Sequences(), collate_fn=collate))):
        step.backward(token_mean_loss(session.model, x, y))
        seen.append(step.indices.tolist())
        if k == 13:
            break
    if not replay and rank == 0:
        Path(tmp, "report.json").write_text(json.dumps({"replans": [e.__dict__ for e in session.partitioner.history]}))
    return seen


def test_a_replayed_plan_gives_the_same_batches(tmp_path):
    first = run_ranks(_replay, world_size=2, timeout_s=90, tmp=str(tmp_path), replay="")
    replans = json.loads((tmp_path / "report.json").read_text())["replans"]
    assert any(abs(r["shares"][1] - 0.5) > 0.02 for r in replans)  # the plan moved away from the equal split
    again = run_ranks(_replay, world_size=2, timeout_s=90, tmp=str(tmp_path),
                      replay=str(tmp_path / "report.json"))
    assert again == first


def test_a_session_left_without_finish_says_so_even_inside_main(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        import poise
        from tests.dist.test_session import LENGTHS, Sequences, _model, collate, token_mean_loss

        def main():  # the usual layout: the session dies with main(), long before the interpreter exits
            session = poise.Session(_model(), poise.Data(lengths=LENGTHS, batch_size=4))
            for k, (step, (x, y)) in enumerate(session.steps(session.dataloader(Sequences(), collate_fn=collate))):
                step.backward(token_mean_loss(session.model, x, y))
                if k == 1:
                    break

        main()
        import gc
        gc.collect()
        print("main returned", file=sys.stderr, flush=True)
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    said = ("poise: 2 steps were trained but session.finish() was never called: no report.json was written (call it "
            "on every rank after the last step)")
    assert said in lines, proc.stderr[-2000:]  # said when the session was dropped, or at exit: once
    assert lines.count(said) == 1
    # neither loss_terms nor num_items: what the weights assume is said once, at the first backward (item 5)
    assert sum("poise weighs each rank's mean loss by its share of the step's samples (Data.loss_terms not given: "
               "one term per sample)" in line for line in lines) == 1, proc.stderr[-2000:]


def _fall_back(rank: int, world_size: int) -> dict:
    """A state loaded, then an older one loaded over it before any step (a resume falling back
    from a checkpoint another rank could not restore), then a step, then a third load."""
    def session() -> poise.Session:
        return poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4))

    first, states = session(), []
    for k, (step, (x, y)) in enumerate(first.steps(first.dataloader(Sequences(), collate_fn=collate))):
        step.backward(token_mean_loss(first.model, x, y))
        states.append(first.state_dict())
        if k == 2:
            break
    second = session()
    second.load_state_dict(states[2])
    second.load_state_dict(states[0])  # the fallback: refused before (issue 57, item 12)
    for step, (x, y) in second.steps(second.dataloader(Sequences(), collate_fn=collate)):
        step.backward(token_mean_loss(second.model, x, y))
        index = step.index
        break
    try:
        second.load_state_dict(states[1])
        late = ""
    except ValueError as exc:
        late = str(exc)
    return {"index": index, "late": late}


def test_an_older_state_can_replace_a_loaded_one_until_the_first_step():
    for result in run_ranks(_fall_back, world_size=2, timeout_s=60):
        assert result["index"] == 1  # the step after the older state's, not after the first one loaded
        assert result["late"] == "load_state_dict after 2 steps: load before the first step"


def _mistakes(rank: int, world_size: int) -> dict:
    """Issue 57's silent mistakes, each tried on a real session: what each rank was told."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    errors: dict[str, str] = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as exc:
            errors[name] = str(exc)

    data = poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4, total_steps=10)
    # a per-step codec under an outer strategy, whose inner steps reduce no gradient (item 3)
    catch("outer_codec", lambda: poise.Session(_model(), data, sync="diloco", comm="powersgd"))

    def half_sharded() -> None:  # the blocks sharded, the root not (item 7)
        model = _model()
        fully_shard(model[0], mesh=init_device_mesh("cpu", (world_size,)))
        poise.Session(model, data)

    catch("root", half_sharded)
    first = poise.Session(_model(), data, balance="cost")
    catch("again", lambda: poise.Session(first.model, data))  # a second session on the same DDP model

    def budget() -> None:
        first.sampler.batch_cost = 1.0

    catch("budget", budget)

    def one_rank() -> None:  # the terms counted on rank 0 only
        for step, (x, y) in first.steps(first.dataloader(Sequences(), collate_fn=collate)):
            step.backward(token_mean_loss(first.model, x, y), num_items=_real_terms(y) if rank == 0 else None)

    catch("one_rank", one_rank)
    session = poise.Session(_model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=4, accum_steps=2))
    optimizer = torch.optim.SGD(session.model.parameters(), lr=0.1)

    def every_micro_batch() -> None:  # accum_steps=2, step.sync ignored (item 4)
        for step, (x, y) in session.steps(session.dataloader(Sequences(), collate_fn=collate)):
            step.backward(token_mean_loss(session.model, x, y))
            optimizer.step()
            optimizer.zero_grad()

    catch("accumulating", every_micro_batch)
    errors["unchanged"] = all(torch.equal(p, q) for p, q in zip(session.module.parameters(), _model().parameters(),
                                                                strict=True))
    return errors


def test_silent_mistakes_are_refused_in_one_line_before_they_train():
    for errors in run_ranks(_mistakes, world_size=2, timeout_s=90):
        assert errors["outer_codec"].startswith("comm.codec='powersgd' compresses the per-step gradient all-reduce, "
                                                "which sync.mode='diloco' never runs")
        assert "SyncConfig(codec=...)" in errors["outer_codec"]
        assert errors["root"].startswith("the model's submodule(s) 0 are sharded with fully_shard but the model "
                                         "itself is not: call fully_shard(model) on the root too")
        assert errors["again"].startswith("this DDP model already has a communication hook")
        assert errors["budget"].startswith("sampler.batch_cost = 1.0: the budget is fixed")
        assert errors["one_rank"] == ("step.backward(num_items=...) counts the loss terms on rank(s) [0] but not on "
                                      "[1]: the count is summed over the ranks, so give it on every rank alike (or on "
                                      "none)")
        assert errors["accumulating"].startswith("optimizer.step() in step 0, a micro-batch that only accumulates "
                                                 "(step.sync is False, accum_steps=2)")
        assert errors["unchanged"]
        assert all("\n" not in v for v in errors.values() if isinstance(v, str))
