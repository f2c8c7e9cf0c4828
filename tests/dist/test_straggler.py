"""Straggler-tolerant aggregation on real gloo ranks, through the public API only.

A rank made persistently slow (``slow:rank=1``) is cut by the deadline: the gradient after
each step must be the exact mean over the loss terms every rank actually computed (several
buckets, with a codec), every rank must agree on the deadline with one small collective a
step, a rank that computes nothing must neither hang nor bias the mean, and over an epoch
every sample must be trained exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import poise
from tests.dist.test_session import LENGTHS, Sequences, collate, token_mean_loss
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def _session(world_size: int, mode: str, delay: str, codec: str) -> poise.Session:
    return poise.Session(
        _model(), poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=8), balance="static",
        comm=poise.CommConfig(codec=codec, start_step=0, error_feedback=False, bucket_mb=0.01),
        straggler=poise.StragglerConfig(mode=mode, micro_batches=4, slack=0.1),
        emulate=poise.EmulateConfig(delay=delay),
    )


class _StallPastTheDeadline:
    """The emulated delays and, once, a stall of 20 deadlines on each of ``ranks`` before the
    first step that has a deadline while ``deadline_s`` is set (the loop sets it to the step's
    deadline before its micro-batches, or to None): the watchdog must enter that step's reduction
    for them while they sleep, whatever the machine's speed. The delay models' stalls alone
    outlast a deadline only when the time a rank predicted was too short, which depends on what
    a busy machine measured."""

    def __init__(self, delays: object, ranks: set[int]) -> None:
        self.delays, self.ranks, self.deadline_s, self.stalled = delays, ranks, None, False

    def before_step(self, rank: int, step: int, predicted_s: float | None) -> float:
        if rank in self.ranks and self.deadline_s is not None and not self.stalled:
            self.stalled = True
            return 20 * self.deadline_s
        return self.delays.before_step(rank, step, predicted_s)

    def after_micro(self, rank: int, step: int, micro: int, compute_s: float) -> float:
        return self.delays.after_micro(rank, step, micro, compute_s)

    def describe(self) -> str:
        return self.delays.describe()


def _steps(rank: int, world_size: int, mode: str, delay: str, codec: str, steps: int) -> dict:
    """Train ``steps`` steps without moving the weights (zero_grad only), recording what each
    step trained, its deadline and its gradient; count the small all-reduces."""
    small = [0]
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if tensor.numel() <= 5 * world_size + 1:
            small[0] += 1
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    session = _session(world_size, mode, delay, codec)
    runner = session.deadline.runner
    pauses = runner.pauses = _StallPastTheDeadline(runner.pauses, ranks={1} if world_size == 3 else set())
    assert len(list(session.model.parameters())) == 6
    out: dict = {"trained": [], "deadlines": [], "grads": [], "small": [], "empty": []}
    loader = DataLoader(Sequences(), batch_sampler=session.sampler, collate_fn=collate)
    for step, micro_batches in session.steps(loader):
        pauses.deadline_s = step.plan.deadline_s
        for x, y in micro_batches:
            step.backward(token_mean_loss(session.model, x, y))
        out["grads"].append([p.grad.clone() for p in session.model.parameters()])
        out["deadlines"].append(step.plan.deadline_s)
        out["planned"] = [*out.get("planned", []), step.plan.queues.planned[rank]]
        session.model.zero_grad()
        step.end()
        out["trained"].append(step.trained.tolist())
        out["small"].append(small[0])
        out["empty"].append(step.empty)
        out["catch_up"] = [*out.get("catch_up", []), step.position < 0]
        out["late"] = [*out.get("late", []), step.plan.joined_late]
        if len(out["trained"]) == steps:
            break
    dist.all_reduce = all_reduce
    out["summary"] = session.deadline.runner.summary()
    return out


@pytest.mark.parametrize(("world_size", "delay", "codec", "rtol"), [
    (2, "slow:rank=1,x=3", "fp16", 3e-3),
    (3, "slow:rank=1,x=30", "none", 1e-5),  # rank 1 is too slow to finish even one micro-batch by the deadline
])
def test_the_gradient_is_the_exact_mean_over_the_terms_computed(world_size, delay, codec, rtol):
    results = run_ranks(_steps, world_size=world_size, timeout_s=120, mode="deadline", delay=delay, codec=codec,
                        steps=8)
    reference = _model()
    steps = len(results[0]["deadlines"])  # 8, or fewer when the epoch ends first
    assert steps >= 4
    for s in range(steps):
        # every rank agrees on the deadline
        assert len({r["deadlines"][s] for r in results}) == 1
        trained = [i for r in results for i in r["trained"][s]]
        assert len(trained) == len(set(trained))
        if not trained:  # nobody reached anything (a catch-up step of a few samples): a zero gradient
            assert all(r["empty"][s] and all(not g.any() for g in r["grads"][s]) for r in results)
            continue
        reference.zero_grad()
        x, y = collate([Sequences()[i] for i in trained])
        token_mean_loss(reference, x, y).backward()
        for r in results:
            for got, want in zip(r["grads"][s], [p.grad for p in reference.parameters()], strict=True):
                torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6)
    # no deadline until most ranks have observed a step (the first is not observed: warm-up);
    # the slow rank, whose micro-batches the others take, may need one more
    deadlines, empty = results[0]["deadlines"], results[0]["empty"]
    assert deadlines[:2] == [None, None], deadlines
    set_at = [s for s, d in enumerate(deadlines) if d is not None]
    # With 3 ranks, 2 rates make a deadline. With 2, the slow rank needs one too: whether it is
    # observed within these steps depends on the machine's load (a CI run beside the rest of the
    # suite set none; every step then waited for both ranks, its gradient exact as checked above)
    assert set_at or world_size == 2, deadlines
    # one small collective a step (the count that also agrees the next deadline)
    assert results[0]["small"] == list(range(1, steps + 1))
    if not set_at:
        return
    # once set, a step has no deadline only after a step where nobody computed anything, or in
    # the epoch's catch-up steps (the pool dealt to few ranks, most of them without a rate yet)
    catch_up = results[0]["catch_up"]
    assert all(deadlines[s] is not None or empty[s - 1] or catch_up[s] for s in range(set_at[0], steps))
    # the slow rank really was cut: the others took over (or deferred) more of its micro-batches
    # than it took of theirs (it may take one in a catch-up step, whose pool is dealt to every
    # rank: whether it does depends on how fast this machine runs the others)
    slow = results[1]["summary"]
    others = sum(r["summary"]["micro_taken_over"] for r in results) - slow["micro_taken_over"]
    assert slow["micro_taken_over"] < others + slow["micro_deferred"]
    if world_size == 3:
        # rank 1's stall past the deadline (_StallPastTheDeadline): its watchdog entered the
        # reduction for it while it slept (those steps' gradients were exact, above); nobody hung.
        # Whether a busy machine also held ranks 0 and 2 past a deadline is not asserted: that
        # depends on the load (3 ranks on 2 cores beside the rest of the suite), not on the code
        assert any(results[1]["late"])


def _epoch(rank: int, world_size: int, mode: str) -> dict:
    # stalls before a step on every rank, so that some steps end with work nobody reached: the
    # epoch's last step certainly (_StallPastTheDeadline on every rank), others by chance
    session = _session(world_size, mode, "bernoulli:p=0.5,x=2", "none")
    runner = session.deadline.runner
    pauses = runner.pauses = _StallPastTheDeadline(runner.pauses, ranks=set(range(world_size)))
    optimizer = torch.optim.SGD(session.model.parameters(), lr=0.01)
    loader = DataLoader(Sequences(), batch_sampler=session.sampler, collate_fn=collate)
    trained, planned, catch_up = [], sorted(int(i) for b in session.sampler for i in b), 0
    session.sampler.set_epoch(0)
    for step, micro_batches in session.steps(loader):
        last = step.position in (len(session.sampler) - 1, -1)
        pauses.deadline_s = step.plan.deadline_s if last else None
        for x, y in micro_batches:
            step.backward(token_mean_loss(session.model, x, y))
        if not step.empty:
            optimizer.step()
        optimizer.zero_grad()
        step.end()
        trained += step.trained.tolist()
        catch_up += step.position < 0
    everything = [None] * world_size
    dist.all_gather_object(everything, trained)
    return {"trained": sorted(i for t in everything for i in t), "planned": planned, "catch_up": catch_up,
            "summary": session.deadline.runner.summary(), "finite": all(torch.isfinite(p).all() for p in
                                                                 session.model.parameters())}


@pytest.mark.parametrize("mode", ["deadline", "deadline+stale"])
def test_every_sample_is_trained_exactly_once_per_epoch(mode):
    results = run_ranks(_epoch, world_size=2, timeout_s=120, mode=mode)
    planned = sorted(i for r in results for i in r["planned"])
    for r in results:
        assert r["trained"] == planned  # once each: nothing dropped, nothing twice
        assert r["finite"]
        assert r["summary"]["pool_left"] == 0
    assert results[0]["catch_up"] >= 1  # the deferred samples were trained at the epoch's end
    assert sum(r["summary"]["micro_deferred"] for r in results) > 0


def test_a_rank_that_computes_nothing_can_send_its_previous_gradient():
    # rank 1 stalls past the first deadline before computing anything (_StallPastTheDeadline):
    # its watchdog sends the gradient it kept from the step before
    results = run_ranks(_steps, world_size=3, timeout_s=120, mode="deadline+stale", delay="slow:rank=1,x=30",
                        codec="none", steps=4)
    assert results[1]["summary"]["stale_steps"] >= 1 and any(results[1]["late"])
    for r in results:
        assert all(torch.isfinite(g).all() for step in r["grads"] for g in step)


def test_delays_without_a_deadline_are_plain_ddp():
    """``straggler='off'`` with injected delays (the baseline of ``poise bench stragglers``):
    every rank computes exactly its own share of every step, nobody takes work from another."""
    results = run_ranks(_steps, world_size=2, timeout_s=120, mode="off", delay="slow:rank=1,x=3", codec="none",
                        steps=4)
    for r in results:
        assert r["summary"]["micro_taken_over"] == 0 and r["summary"]["micro_deferred"] == 0
        assert all(d is None for d in r["deadlines"])
    for s in range(4):
        trained = [sorted(r["trained"][s]) for r in results]
        assert all(len(t) == 8 for t in trained) and not set(trained[0]) & set(trained[1])


def _two_micro_batches_a_step(rank: int, world_size: int, steps: int) -> dict:
    """A loop that leaves its micro-batches after the second, every step, beside a rank whose
    stalls outlast the deadline (its watchdog may be waiting for the step's lock then): what
    each step trained and its gradient."""
    session = _session(world_size, "deadline", "slow:rank=1,x=30", "none")
    loader = DataLoader(Sequences(), batch_sampler=session.sampler, collate_fn=collate)
    out: dict = {"trained": [], "deadlines": [], "grads": []}
    for step, micro_batches in session.steps(loader):
        for n, (x, y) in enumerate(micro_batches):
            step.backward(token_mean_loss(session.model, x, y))
            if n == 1:
                break
        step.end()
        out["grads"].append([p.grad.clone() for p in session.model.parameters()])
        session.model.zero_grad()
        out["trained"].append(step.trained.tolist())
        out["deadlines"].append(step.plan.deadline_s)
        if len(out["trained"]) == steps:
            break
    return out


def test_leaving_the_micro_batch_loop_early_keeps_the_mean_exact_and_nobody_hangs():
    results = run_ranks(_two_micro_batches_a_step, world_size=3, timeout_s=120, steps=8)
    assert any(d is not None for d in results[0]["deadlines"])  # the watchdogs were armed
    reference = _model()
    for s in range(8):
        trained = [i for r in results for i in r["trained"][s]]
        assert len(trained) == len(set(trained))
        assert all(len(r["trained"][s]) <= 4 for r in results)  # two micro-batches of 2 at most
        if trained:  # the micro-batch the loop was left after counts: the mean is over what was computed
            reference.zero_grad()
            x, y = collate([Sequences()[i] for i in trained])
            token_mean_loss(reference, x, y).backward()
            for got, want in zip(results[0]["grads"][s], [p.grad for p in reference.parameters()], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


EQUAL = np.full(160, 12)  # equal lengths: a step's split is a count of samples, not a cost grouping


class EqualSequences(Dataset):
    """Sample i: 12 random features in [0, 1) and a target per position."""

    def __len__(self) -> int:
        return len(EQUAL)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.rand(int(EQUAL[i]), 4, generator=g), torch.rand(int(EQUAL[i]), 1, generator=g)


def _dynamic(rank: int, world_size: int, delay: str, epochs: int) -> dict:
    """``balance='dynamic'`` with deadline steps, over several epochs: rank 1's planned share
    of each step (its list's samples over the step's), the re-plans, and what was trained."""
    session = poise.Session(
        _model(), poise.Data(lengths=EQUAL, batch_size=16),
        balance=poise.BalanceConfig(strategy="dynamic", cold_start_steps=3, replan_every_steps=2),
        straggler=poise.StragglerConfig(mode="deadline", micro_batches=4, slack=0.1),
        emulate=poise.EmulateConfig(delay=delay),
    )
    loader = DataLoader(EqualSequences(), batch_sampler=session.sampler, collate_fn=collate)
    shares, trained = [], []
    for epoch in range(epochs):
        session.sampler.set_epoch(epoch)
        epoch_trained: list[int] = []
        for step, micro_batches in session.steps(loader):
            for x, y in micro_batches:
                step.backward(token_mean_loss(session.model, x, y))
            if step.position >= 0:
                planned = [sum(len(m) for m in q) for q in step.plan.queues.micro[:2]]
                shares.append(planned[1] / sum(planned))
            session.model.zero_grad()
            step.end()
            epoch_trained += step.trained.tolist()
        everything = [None] * world_size
        dist.all_gather_object(everything, epoch_trained)
        trained.append(sorted(i for t in everything for i in t))
    return {"shares": shares, "trained": trained,
            "replans": [(e.step, [round(x) for x in e.speeds], e.shares, e.decision)
                        for e in session.partitioner.history]}


def test_dynamic_balancing_moves_persistent_slowness_out_of_the_deadline():
    """Persistent slowness moves the shares (the balancer), not only the work within each step
    (the deadline's take-overs): rank 1 at 7x its compute plans less and less of each step,
    and every sample is still trained once per epoch."""
    results = run_ranks(_dynamic, world_size=2, timeout_s=180, delay="slow:rank=1,x=6", epochs=3)
    shares = results[0]["shares"]
    assert results[0]["shares"] == results[1]["shares"]  # every rank plans the same steps
    assert abs(shares[0] - 0.5) < 0.05  # the cold start: an equal split (to a sample)
    assert max(shares[-4:]) < 0.35, (shares, results[0]["replans"])  # rank 1's share moved down
    for epoch in results[0]["trained"]:
        assert epoch == list(range(len(EQUAL)))  # once each
