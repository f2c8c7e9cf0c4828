"""Outer-step synchronization (local SGD, DiLoCo, Streaming DiLoCo) on real gloo ranks, through
poise.Session: what the outer step computes, that inner steps send nothing, that its state
resumes bit for bit, compressed changes with error feedback, token-weighted averages of
unequal rounds, and a rank that trained nothing."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import poise
from poise.balance.weights import loss_weight
from poise.config import CommConfig, SyncConfig
from poise.runtime.clock import clock_for
from poise.sync import Outer
from poise.sync.auto import AutoTrial
from poise.sync.nodes import Nodes, make_nodes, piece
from poise.sync.outer import choose_inner_steps, fragments, launch_step, per_step_pays
from tests.dist.test_session import LENGTHS, Sequences, collate, token_mean_loss
from tests.harness import run_ranks

pytestmark = pytest.mark.dist


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(rank: int, world_size: int, sync: SyncConfig | str, steps: int, *, balance: str = "static",
           speeds: list[float] | None = None, lr: float = 0.1, adam: bool = False, state: dict | None = None,
           stop_at: int | None = None, batch_size: int = 4, model: Callable[[], nn.Module] = _model,
           save_inside: int | None = None, finish: bool = False) -> dict:
    """``steps`` optimizer steps of a small model with SGD (or AdamW); parameters after each.
    ``stop_at``: state saved after that step ends, and the loop left; ``save_inside``: state
    saved inside that step, after the optimizer step (where the docs show it), the loop going
    on; ``finish``: ``session.finish()`` after the loop (the report and the parameters after it)."""
    data = poise.Data(lengths=LENGTHS, batch_size=batch_size if balance == "static" else None,
                      batch_cost=None if balance == "static" else world_size * batch_size * 20.0,
                      loss_terms=LENGTHS, total_steps=steps)
    session = poise.Session(model(), data, balance=balance, sync=sync)
    if speeds is not None:
        session.sampler.set_speeds(speeds)
    params = [p for p in session.model.parameters()]
    opt = (torch.optim.AdamW(params, lr=lr) if adam else torch.optim.SGD(params, lr=lr))
    if state is not None:
        opt.load_state_dict(state["optim"])
        session.load_state_dict(state["session"])
    loader = session.dataloader(Sequences(), collate_fn=collate)
    out: dict = {"params": [], "tokens": [], "bytes": [], "between": []}
    done = session.steps_done
    for step, (x, y) in session.steps(loader):
        step.backward(token_mean_loss(session.model, x, y))
        opt.step()
        opt.zero_grad()
        out["tokens"].append(int(LENGTHS[step.indices].sum()))
        if save_inside is not None and done + 1 == save_inside:
            # copied: the optimizer's and the codec's state tensors go on changing in place
            out["inside"] = copy.deepcopy({"optim": opt.state_dict(), "session": session.state_dict()})
        step.end()
        record = session.last_record
        out["bytes"].append(record.wire_bytes if record is not None else 0)
        out["between"].append(record.inter_node_wire_bytes if record is not None else 0)
        out["params"].append(_params(session.model))
        done += 1
        if stop_at is not None and done == stop_at:
            out["state"] = {"optim": opt.state_dict(), "session": session.state_dict()}
            break
        if done == steps:
            break
    out["summary"] = session.sync.summary()
    if finish:
        out["report"] = session.finish()
        out["finished"] = _params(session.model)
    return out


def _ddp_reference(rank: int, world_size: int, steps: int, model: Callable[[], nn.Module] = _model) -> dict:
    return _train(rank, world_size, "step", steps, model=model)


def test_local_sgd_with_one_inner_step_is_ddp():
    """H = 1, outer SGD lr 1 without momentum (local SGD), inner SGD: every step averages the
    ranks' parameters, which is DDP's step on the averaged gradient (equal batches)."""
    outer = run_ranks(_train, world_size=2, timeout_s=90, sync=SyncConfig(mode="local_sgd", inner_steps=1),
                      steps=6)
    ddp = run_ranks(_ddp_reference, world_size=2, timeout_s=90, steps=6)
    for a, b in zip(outer[0]["params"], ddp[0]["params"], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for a, b in zip(outer[0]["params"][-1], outer[1]["params"][-1], strict=True):
        assert torch.equal(a, b)


def test_inner_steps_send_nothing_and_ranks_meet_at_the_outer_step():
    """DiLoCo with H = 3: steps 1 and 2 put no byte on the wire and the ranks' parameters
    differ; step 3 sends the model once and leaves every rank with the same parameters."""
    results = run_ranks(_train, world_size=2, timeout_s=90, sync=SyncConfig(mode="diloco", inner_steps=3), steps=6,
                        adam=True, lr=0.01)
    r0, r1 = results
    assert r0["bytes"][0] == 0 and r0["bytes"][1] == 0 and r0["bytes"][2] > 0
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"][1], r1["params"][1], strict=True))
    for index in (2, 5):
        assert all(torch.equal(a, b) for a, b in zip(r0["params"][index], r1["params"][index], strict=True))
    assert r0["summary"]["outer_steps"] == 2 and r0["summary"]["mode"] == "diloco"


def test_warmup_steps_synchronize_every_step_then_rounds_begin():
    """sync.warmup_steps = 2: the first two steps all-reduce gradients as DDP does (the ranks'
    parameters equal after each, bytes every step), then rounds of H = 2 begin: step 3 sends
    nothing, step 4 is an outer step."""
    results = run_ranks(_train, world_size=2, timeout_s=90,
                        sync=SyncConfig(mode="diloco", inner_steps=2, warmup_steps=2), steps=6, adam=True, lr=0.01)
    r0, r1 = results
    assert r0["bytes"][0] > 0 and r0["bytes"][1] > 0 and r0["bytes"][2] == 0 and r0["bytes"][3] > 0
    for index in (0, 1, 3, 5):
        assert all(torch.equal(a, b) for a, b in zip(r0["params"][index], r1["params"][index], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"][2], r1["params"][2], strict=True))
    assert r0["summary"]["outer_steps"] == 2


def _outer_by_hand(starts: list[list[torch.Tensor]], locals_: list[list[list[torch.Tensor]]], weights: list[float],
                   lr: float, mu: float) -> list[torch.Tensor]:
    """Two DiLoCo outer steps computed here, from each rank's parameters before each one."""
    global_ = [t.clone() for t in starts[0]]
    momentum = [torch.zeros_like(t) for t in global_]
    for round_ in range(len(locals_[0])):
        avg = [sum(w * (g - loc[round_][i]) for w, loc in zip(weights[round_], locals_, strict=True))
               for i, g in enumerate(global_)]
        for i in range(len(global_)):
            momentum[i] = mu * momentum[i] + avg[i]
            global_[i] = global_[i] - lr * (avg[i] + mu * momentum[i])
    return global_


def _pre_outer(rank: int, world_size: int, steps: int, inner: int, speeds: list[float] | None) -> dict:
    """Like _train, also capturing each rank's parameters just before every outer step."""
    captured: list[list[torch.Tensor]] = []
    original = poise.sync.Outer._launch

    def spy(self, fragment, delay=None):  # the rank's parameters at the moment it sends
        captured.append([p.detach().clone() for p in self.params])
        return original(self, fragment, delay)

    poise.sync.Outer._launch = spy
    try:
        out = _train(rank, world_size, SyncConfig(mode="diloco", inner_steps=inner), steps,
                     balance="static" if speeds is None else "cost", speeds=speeds, adam=True, lr=0.01)
    finally:
        poise.sync.Outer._launch = original
    out["captured"] = captured
    out["start"] = _params(_model())
    return out


@pytest.mark.parametrize("speeds", [None, [1.0, 3.0]])
def test_outer_step_is_the_token_weighted_nesterov_step(speeds):
    """The parameters after two outer steps equal DiLoCo's outer Nesterov step computed by hand
    from each rank's parameters before each one, weighted by the tokens each rank trained in the
    round (with speeds 1:3 rank 1 trains about three times the tokens: unequal weights)."""
    results = run_ranks(_pre_outer, world_size=2, timeout_s=90, steps=4, inner=2, speeds=speeds)
    tokens = [r["tokens"] for r in results]
    weights = []
    for round_ in range(2):
        mine = [sum(t[2 * round_: 2 * round_ + 2]) for t in tokens]
        weights.append([m / sum(mine) for m in mine])
    if speeds is not None:
        assert weights[0][1] > 0.6  # the faster rank trained most of the round's tokens
    expected = _outer_by_hand([results[0]["start"]], [r["captured"] for r in results], weights, lr=0.7, mu=0.9)
    for got, want in zip(results[0]["params"][-1], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_outer_state_resumes_bit_for_bit():
    """Stopped inside an outer round (step 4 of H = 3) with its state saved, and resumed in a
    fresh session: the next steps' parameters equal an uninterrupted run's, bit for bit, with the
    outer momentum, the rank's own parameters and the residuals carried over (int8, streaming)."""
    sync = SyncConfig(mode="streaming", inner_steps=4, fragments=2, delay_steps=1, codec="int8")
    whole = run_ranks(_train, world_size=2, timeout_s=90, sync=sync, steps=9, adam=True, lr=0.01)
    # one run saves twice: inside step 4 after its optimizer step (the docs' place; fragment 1's
    # outer step is due at its end), and after step 5 ended
    first = run_ranks(_train, world_size=2, timeout_s=90, sync=sync, steps=9, adam=True, lr=0.01, stop_at=5,
                      save_inside=4)
    assert first[0]["inside"]["session"]["steps_done"] == 4 and first[0]["inside"]["session"]["step_end"]
    rest = run_ranks(_resume, world_size=2, timeout_s=90, sync=sync, states=[[r["inside"], r["state"]] for r in first])
    for rank in range(2):
        for resumed in rest[rank]:
            for got, want in zip(resumed["params"][-1], whole[rank]["params"][-1], strict=True):
                assert torch.equal(got, want)
            assert resumed["summary"]["outer_steps"] == whole[rank]["summary"]["outer_steps"] == 6
    # the run's last step gives every rank the global model (not mixed into its own)
    assert all(torch.equal(a, b) for a, b in zip(whole[0]["params"][-1], whole[1]["params"][-1], strict=True))


def _resume(rank: int, world_size: int, sync: SyncConfig, states: list[list[dict]]) -> list[dict]:
    """A fresh session resumed from each of this rank's states in turn, to the run's end."""
    return [_train(rank, world_size, sync, 9, adam=True, lr=0.01, state=state) for state in states[rank]]


def test_a_loop_left_early_ends_with_one_model_and_its_traffic_reported():
    """DiLoCo with H = 3 over 9 planned steps, the loop left after step 5 (an early stop): the
    ranks' parameters differ there, and finish() averages their changes once more, so every
    rank ends with the same model (said in the report); the report's bytes per step are the
    outer steps' bytes over every step, not the median step's 0."""
    results = run_ranks(_train, world_size=2, timeout_s=90, sync=SyncConfig(mode="diloco", inner_steps=3), steps=9,
                        adam=True, lr=0.01, stop_at=5, finish=True)
    r0, r1 = results
    assert not _same(r0["params"][-1], r1["params"][-1])
    assert _same(r0["finished"], r1["finished"]) and not _same(r0["finished"], r0["params"][-1])
    report = r0["report"]
    assert report["sync"]["final_sync_at_finish"] and report["sync"]["outer_steps"] == 2
    assert report["comm_wire_bytes_per_step"] == 0  # the median step sends nothing
    assert report["bytes_communicated_per_step"] == pytest.approx(sum(r0["bytes"][1:]) / 4)
    assert report["compression_ratio"] == 1.0


# (codec, top-k ratio, the largest distance from the exact run as a share of the exact run's change)
COMPRESSED = [("fp16", 1.0, 0.02), ("int8", 1.0, 0.5), ("topk", 1.0, 1e-3), ("topk", 0.5, 1.0)]


@pytest.mark.parametrize(("codec", "ratio", "share"), COMPRESSED)
def test_compressed_changes_with_error_feedback_track_the_exact_ones(codec, ratio, share):
    """DiLoCo with a compressed outer change stays near the exact one: casts and int8 closely,
    top-k sending every entry exactly (through the all-gather path, weights included), top-k of
    half the entries within the exact run's own change after four rounds (error feedback sends
    the rest later); each sends fewer bytes than the exact change, except top-k of every entry
    (values and indices)."""
    exact = run_ranks(_train, world_size=2, timeout_s=90, sync=SyncConfig(mode="diloco", inner_steps=2), steps=8,
                      adam=True, lr=0.01)
    packed = run_ranks(_train, world_size=2, timeout_s=90,
                       sync=SyncConfig(mode="diloco", inner_steps=2, codec=codec, topk_ratio=ratio), steps=8,
                       adam=True, lr=0.01)
    if ratio < 1.0 or codec != "topk":
        assert sum(packed[0]["bytes"]) < sum(exact[0]["bytes"])
    change = sum(float((a - s).norm()) for a, s in zip(exact[0]["params"][-1], _params(_model()), strict=True))
    gap = sum(float((a - b).norm()) for a, b in zip(packed[0]["params"][-1], exact[0]["params"][-1], strict=True))
    assert gap < share * change


def _idle_rank(rank: int, world_size: int) -> dict:
    """Rank 1's batches are empty in every step (speeds 1:0 plan it nothing): the outer steps
    still meet, its weight is 0, and the result is rank 0's own training."""
    return _train(rank, world_size, SyncConfig(mode="local_sgd", inner_steps=2), 4, balance="cost",
                  speeds=[1.0, 1e-9])


def test_a_rank_that_trained_nothing_neither_hangs_nor_counts():
    results = run_ranks(_idle_rank, world_size=2, timeout_s=90)
    assert sum(results[1]["tokens"]) < sum(results[0]["tokens"])
    for a, b in zip(results[0]["params"][-1], results[1]["params"][-1], strict=True):
        assert torch.equal(a, b)


# -- the pure parts ---------------------------------------------------------------------------


def test_fragments_split_contiguously_and_evenly():
    assert fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert fragments([100, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert fragments([5, 5], 8) == [[0], [1]]
    groups = fragments(list(np.random.default_rng(0).integers(1, 1000, 40)), 4)
    assert [i for g in groups for i in g] == list(range(40)) and len(groups) == 4


def test_fragments_launch_in_turn_at_equal_spacing():
    assert [launch_step(f, 4, 20) for f in range(4)] == [5, 10, 15, 0]
    assert [launch_step(0, 1, 20)] == [0]


def test_auto_picks_per_step_sync_when_it_is_cheap_and_the_fewest_inner_steps_otherwise():
    assert per_step_pays(0.1, 1.0, 0.15) and per_step_pays(0.15, 1.0, 0.15) and per_step_pays(5.0, 0.0, 0.15)
    assert not per_step_pays(0.16, 1.0, 0.15)
    assert choose_inner_steps(0.01, 1.0, 0.05) == 1
    assert choose_inner_steps(0.5, 1.0, 0.05) == 10
    assert choose_inner_steps(100.0, 1.0, 0.05) == 500
    assert choose_inner_steps(0.06, 1.0, 0.05) == 2
    assert choose_inner_steps(0.5, 1.0, 0.05, steps_left=50) == 5  # ten rounds at least


def _auto(rank: int, world_size: int, steps: int = 10, recorded: tuple[float, float] | None = None) -> dict:
    """``steps`` of ``sync='auto'``. ``recorded``: the (compute s, communication s) that every timed
    step of auto's trial reports instead of what this machine measures, so that the decision
    under test is the one those figures call for, however loaded the machine; the ranks still
    agree on them through their all-reduce, and run what was chosen."""
    if recorded is not None:
        compute_s, comm_s = recorded
        ddp_step, synchronized_step = AutoTrial.ddp_step, AutoTrial.synchronized_step
        AutoTrial.ddp_step = lambda self, _c, _e: ddp_step(self, compute_s, comm_s)  # this rank's process only
        AutoTrial.synchronized_step = lambda self, _c, _s, left: synchronized_step(self, compute_s, comm_s, left)
    out = _train(rank, world_size, SyncConfig(mode="auto", auto_trial_steps=3), steps)
    dist.barrier()
    return out


def test_auto_decides_alike_on_every_rank_and_says_why():
    results = run_ranks(_auto, world_size=2, timeout_s=90)
    choices = [r["summary"]["auto"] for r in results]
    assert choices[0] is not None and choices[0]["mode"] == choices[1]["mode"]
    assert choices[0]["inner_steps"] == choices[1]["inner_steps"] and "synchroniz" in choices[0]["why"]


def test_auto_keeps_every_step_when_ddp_hides_its_communication_and_is_then_ddp_bit_for_bit():
    """DDP's steps recorded at 0.2 s of compute and 1 ms of exposed communication (far below 15 %
    of compute): auto decides after its 3 DDP steps, never runs an outer step, and every step's
    parameters are plain DDP's."""
    auto = run_ranks(_auto, world_size=2, timeout_s=90, steps=6, recorded=(0.2, 0.001))
    ddp = run_ranks(_ddp_reference, world_size=2, timeout_s=90, steps=6)
    choice = auto[0]["summary"]["auto"]
    assert choice["mode"] == "step" and "exposed" in choice["why"] and auto[0]["summary"]["outer_steps"] == 0
    assert (choice["ddp_compute_s"], choice["ddp_exposed_s"]) == pytest.approx((0.2, 0.001))
    for a, d in zip(auto[0]["params"], ddp[0]["params"], strict=True):
        assert _same(a, d)


def test_auto_takes_outer_steps_when_ddp_waits_for_its_all_reduce():
    """Steps recorded at 10 ms of compute and 50 ms of communication: DDP's exposed share exceeds
    15 %, so auto times 3 fully synchronized steps after its 3 DDP steps, then chooses outer
    steps (plain averaging: too few rounds left for DiLoCo), runs them, and the ranks end alike."""
    results = run_ranks(_auto, world_size=2, timeout_s=120, steps=12, recorded=(0.01, 0.05))
    choice = results[0]["summary"]["auto"]
    assert choice["mode"] == "local_sgd" and choice["inner_steps"] >= 2, choice
    assert choice["ddp_exposed_s"] > 0.15 * choice["ddp_compute_s"] and "exposed" in choice["why"]
    assert results[0]["summary"]["outer_steps"] > 0
    assert _same(results[0]["params"][-1], results[1]["params"][-1])


# -- inner_scope = node: a node's ranks train as one replica ---------------------------------


def _as_nodes(rank: int, world_size: int, sync: SyncConfig | str, steps: int, per_node: int = 2,
              capture: bool = False, **kwargs: object) -> dict:
    """``_train`` with ``per_node`` ranks a node (``LOCAL_WORLD_SIZE``, as ``poise train`` sets it),
    capturing each rank's parameters just before every outer step if asked."""
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    captured: list[list[torch.Tensor]] = []
    original = poise.sync.Outer._launch

    def spy(self, fragment, delay=None):
        captured.append([p.detach().clone() for p in self.params])
        return original(self, fragment, delay)

    if capture:
        poise.sync.Outer._launch = spy
    try:
        out = _train(rank, world_size, sync, steps, **kwargs)
    finally:
        poise.sync.Outer._launch = original
    out["captured"], out["start"] = captured, _params(_model())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_node_scope_trains_each_node_as_one_replica_and_meets_by_node():
    """2 nodes x 2 ranks, DiLoCo with H = 3, unequal batches (speeds 1:2 in node 0, 3:3 in node
    1): a node's ranks hold the same parameters after every step; the nodes differ inside a
    round and all four ranks agree after each outer step, which is DiLoCo's Nesterov step on the
    nodes' changes weighted by each node's tokens in the round. Inner steps send gradients
    within the node only; an outer step sends half the model's change between nodes per rank."""
    sync = SyncConfig(mode="diloco", inner_steps=3, inner_scope="node")
    results = run_ranks(_as_nodes, world_size=4, timeout_s=120, sync=sync, steps=6, capture=True, balance="cost",
                        speeds=[1.0, 2.0, 3.0, 3.0], adam=True, lr=0.01)
    for step in range(6):
        assert _same(results[0]["params"][step], results[1]["params"][step])
        assert _same(results[2]["params"][step], results[3]["params"][step])
    assert not _same(results[0]["params"][1], results[2]["params"][1])
    for step in (2, 5):
        assert _same(results[0]["params"][step], results[3]["params"][step])
    node_tokens = [[sum(sum(r["tokens"][3 * k: 3 * k + 3]) for r in results[2 * n: 2 * n + 2]) for n in range(2)]
                   for k in range(2)]
    weights = [[t / sum(ts) for t in ts] for ts in node_tokens]
    assert weights[0][1] > 0.55  # node 1 trained more of the round's tokens
    expected = _outer_by_hand([results[0]["start"]], [results[0]["captured"], results[2]["captured"]], weights,
                              lr=0.7, mu=0.9)
    for got, want in zip(results[3]["params"][-1], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    piece_bytes = 4 * -(-sum(p.numel() for p in _model().parameters()) // 2)
    r0 = results[0]
    assert r0["bytes"][0] > 0 and r0["between"][0] == 0 and r0["between"][1] == 0
    assert r0["between"][2] == piece_bytes and r0["between"][5] == piece_bytes
    assert r0["summary"]["inner_scope"] == "node" and r0["summary"]["ranks_per_node"] == 2


def _node_gradients(rank: int, world_size: int) -> dict:
    """Outer driven by hand over two steps: a warm-up step (the world's loss weights, every step
    synchronized) and an inner step (the node's weights, from ``loss_scope``), each rank with its
    own number of samples; the gradients after each backward and the exact ones of the batches
    of the ranks the weight is a share of, computed in one process."""
    config = SyncConfig(mode="local_sgd", inner_scope="node", inner_steps=2, warmup_steps=1)
    outer = Outer(_model(), CommConfig(), config, clock=clock_for(torch.device("cpu")), backend="gloo",
                  compression_start=0, world_size=world_size, last_step=4, ranks_per_node=2)
    sizes = [3, 7, 2, 12]  # samples per rank: unequal within each node and between the nodes
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)) for n in sizes]
    opt = torch.optim.SGD(outer.model.parameters(), lr=0.1)
    out: dict = {"grads": [], "exact": [], "groups": []}
    for step in range(2):
        ranks = outer.loss_scope.ranks
        group = list(range(world_size)) if ranks is None else list(ranks)
        weight = loss_weight([np.arange(sizes[r]) for r in group], group.index(rank))
        reference = _model()
        reference.load_state_dict(outer.model.module.state_dict())
        x = torch.cat([data[r][0] for r in group])
        y = torch.cat([data[r][1] for r in group])
        nn.functional.mse_loss(reference(x), y).backward()
        outer.begin_step(step)
        outer.micro_batch(True)
        x, y = data[rank]
        loss = nn.functional.mse_loss(outer.model(x), y) * weight
        outer.backward(loss.backward)
        out["grads"].append([p.grad.clone() for p in outer.params])
        out["exact"].append([p.grad.clone() for p in reference.parameters()])
        out["groups"].append(group)
        opt.step()
        opt.zero_grad()
        outer.end_step(step, tokens=float(sizes[rank]), optimizer_step=True)
    return out


def test_node_scope_gradients_are_the_exact_token_weighted_means():
    """With the weights the session gives (the world's during the warm-up, the node's share of its
    terms between outer steps: ``loss_scope``), the warm-up step's gradient is the world's exact
    one on every rank (the node's all-reduce, then the nodes' average), and an inner step's is
    the exact mean over the node's batches: nodes of consecutive ranks."""
    results = run_ranks(_node_gradients, world_size=4, timeout_s=120)
    assert results[0]["groups"] == [[0, 1, 2, 3], [0, 1]] and results[3]["groups"][1] == [2, 3]
    for r in results:
        for step in range(2):
            for got, want in zip(r["grads"][step], r["exact"][step], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert _same(results[0]["grads"][1], results[1]["grads"][1])
    assert not _same(results[0]["grads"][1], results[2]["grads"][1])


def _ddp_unequal(rank: int, world_size: int) -> dict:
    return _train(rank, world_size, "step", 5, balance="cost", speeds=[1.0, 3.0])


def test_node_scope_on_one_node_is_ddp_at_every_step():
    """One node of 2 ranks with unequal batches: local SGD by node with H = 2 is plain DDP, bit for
    bit, at every step (the node's all-reduce of the world-weighted losses; the outer step has no
    one to meet and keeps the parameters as they are)."""
    node = run_ranks(_as_nodes, world_size=2, timeout_s=90, sync=SyncConfig(mode="local_sgd", inner_steps=2,
                                                                            inner_scope="node"),
                     steps=5, balance="cost", speeds=[1.0, 3.0])
    ddp = run_ranks(_ddp_unequal, world_size=2, timeout_s=90)
    assert node[0]["tokens"] != node[1]["tokens"]
    for rank in range(2):
        for got, want in zip(node[rank]["params"], ddp[rank]["params"], strict=True):
            assert _same(got, want)
    assert node[0]["summary"]["outer_steps"] == 3 and sum(node[0]["between"]) == 0


def test_node_scope_streaming_with_int8_resumes_bit_for_bit():
    """Streaming DiLoCo by node, int8 outer changes: stopped inside a round (a fragment's result in
    flight) and resumed in fresh sessions, every rank's parameters equal the uninterrupted run's
    bit for bit; a node's ranks agree inside a round, and the run's last step leaves all four
    alike (the global model, not mixed into each node's own)."""
    sync = SyncConfig(mode="streaming", inner_steps=4, fragments=2, delay_steps=1, codec="int8", inner_scope="node")
    whole = run_ranks(_as_nodes, world_size=4, timeout_s=120, sync=sync, steps=6, adam=True, lr=0.01)
    first = run_ranks(_as_nodes, world_size=4, timeout_s=120, sync=sync, steps=6, adam=True, lr=0.01, stop_at=4)
    rest = run_ranks(_node_resume, world_size=4, timeout_s=120, sync=sync, states=[r["state"] for r in first])
    for rank in range(4):
        assert _same(rest[rank]["params"][-1], whole[rank]["params"][-1])
        assert _same(whole[rank]["params"][-1], whole[0]["params"][-1])
    assert _same(whole[0]["params"][4], whole[1]["params"][4]) and _same(whole[2]["params"][4], whole[3]["params"][4])
    assert not _same(whole[0]["params"][4], whole[2]["params"][4])
    assert whole[0]["summary"]["outer_steps"] == 4  # fragment 0 after step 3, 1 after step 5, both at the last


def _node_resume(rank: int, world_size: int, sync: SyncConfig, states: list[dict]) -> dict:
    return _as_nodes(rank, world_size, sync, 6, adam=True, lr=0.01, state=states[rank])


def test_node_layout_is_refused_when_it_does_not_divide_the_world_and_pieces_cover_the_change():
    with pytest.raises(ValueError, match="3 ranks per node") as info:
        make_nodes("node", 0, 4, 3)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="inner_scope='cluster' is unknown"):
        SyncConfig(mode="diloco", inner_scope="cluster")
    with pytest.raises(ValueError, match=r"not sync\.mode='step'"):
        SyncConfig(mode="step", inner_scope="node")
    flat = torch.arange(5.0)
    pieces = [piece(flat, Nodes("node", 2, 2, 0, j)) for j in range(2)]
    assert torch.equal(torch.cat(pieces), torch.tensor([0.0, 1, 2, 3, 4, 0]))
    assert piece(flat, Nodes("rank", 2, 2, 0, 1)) is flat  # rank scope: every rank sends all of it
