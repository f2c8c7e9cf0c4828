"""poise.train.optim.AdamW: torch's AdamW until the freeze, then Adam's update with the second moment fixed."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from poise.comm import registry
from poise.config import CommConfig
from poise.train.optim import AdamW

pytestmark = pytest.mark.timeout(60)


def _pair(freeze_after: int | None, denominator_floor: float = 0.01, **kwargs):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    options = {"lr": 0.05, "weight_decay": 0.1, **kwargs}
    ours = AdamW([b], freeze_after=freeze_after, denominator_floor=denominator_floor, **options)
    return a, b, torch.optim.AdamW([a], **options), ours


def _grads(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(6, 5, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("fused", [False, True])
def test_equals_torch_adamw_before_the_freeze_and_without_one(fused):
    for freeze_after in (None, 4):
        a, b, ref, ours = _pair(freeze_after, fused=fused)
        for g in _grads(4 if freeze_after else 7):
            a.grad, b.grad = g.clone(), g.clone()
            ref.step()
            ours.step()
            assert torch.equal(a, b)


def test_frozen_steps_follow_adams_formula_with_the_variance_of_the_freeze():
    _, b, _, ours = _pair(3, denominator_floor=0.0)
    grads = _grads(6)
    beta1, beta2 = ours.param_groups[0]["betas"]
    eps, lr, wd = 1e-8, 0.05, 0.1
    for g in grads[:3]:
        b.grad = g.clone()
        ours.step()
    v = ours.state[b]["exp_avg_sq"].clone()
    m = ours.state[b]["exp_avg"].clone()
    x = b.detach().clone()
    for t, g in enumerate(grads[3:], start=4):
        b.grad = g.clone()
        ours.step()
        m = beta1 * m + (1 - beta1) * g
        x = x * (1 - lr * wd) - lr * (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** 3)).sqrt() + eps)
        torch.testing.assert_close(b.detach(), x, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.state[b]["exp_avg_sq"], v)  # frozen
    assert ours.steps_done() == 6


def test_entries_without_gradient_in_the_warm_up_get_a_bounded_step():
    p = torch.nn.Parameter(torch.zeros(100))
    opt = AdamW([p], lr=1.0, weight_decay=0.0, freeze_after=2, denominator_floor=0.01)
    for _ in range(2):
        p.grad = torch.cat([torch.ones(99), torch.zeros(1)])  # the last entry never had a gradient
        opt.step()
    p.grad = torch.ones(100)
    before = p.detach().clone()
    opt.step()
    step = (before - p.detach()).abs()
    assert float(step[-1]) <= 100.0 * float(step[0]) + 1e-6  # not 1 / eps


def test_checkpoint_round_trip_keeps_the_freeze():
    _, b, _, ours = _pair(2)
    for g in _grads(3):
        b.grad = g.clone()
        ours.step()
    c = torch.nn.Parameter(b.detach().clone())
    other = AdamW([c], lr=0.05, weight_decay=0.1)  # no freeze configured: the state brings it
    other.load_state_dict(copy.deepcopy(ours.state_dict()))  # as from a file: no shared tensors
    assert other.param_groups[0]["freeze_after"] == 2
    g = _grads(4)[3]
    b.grad, c.grad = g.clone(), g.clone()
    ours.step()
    other.step()
    assert torch.equal(b, c)


def test_bad_arguments_are_one_line_errors():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="freeze_after=0"):
        AdamW(p, freeze_after=0)
    with pytest.raises(ValueError, match="denominator_floor=2"):
        AdamW(p, denominator_floor=2)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(p, freeze_after=3, amsgrad=True)


def test_compression_start_rule():
    assert registry.compression_start(CommConfig(codec="int8"), 300, 10) == 2
    assert registry.compression_start(CommConfig(codec="topk"), 300, 10) == 20  # lossy: a longer warm-up
    assert registry.compression_start(CommConfig(codec="sign"), 300, 10) == 20  # twice the warm-up
    assert registry.compression_start(CommConfig(codec="sign"), 1000, 10) == 50  # a twentieth of the run
    assert registry.compression_start(CommConfig(codec="sign", start_step=7), 1000, 10) == 7  # explicit wins
    assert registry.compression_start(CommConfig(codec="int8", freeze_variance="on"), 300, 10) == 20
    assert not registry.freezes_variance(CommConfig(codec="sign", freeze_variance="off"))
    with pytest.raises(ValueError, match="freeze_variance='sometimes'"):
        CommConfig(freeze_variance="sometimes")


def test_the_learning_rate_schedule_warms_up_decays_and_then_stays_at_a_tenth():
    """A run longer than its schedule (train.schedule_steps) trains on at the schedule's final rate."""
    from poise.train.recipe import lr_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = lr_schedule(optimizer, warmup_steps=10, total_steps=100)
    rates = []
    for _ in range(150):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)  # linear warm-up
    assert all(a >= b for a, b in itertools.pairwise(rates[9:101]))  # cosine decay
    assert rates[100:] == pytest.approx([0.1] * 50)
    span = [100]  # a span read at every step (auto's choice sets it)
    scheduler = lr_schedule(optimizer, warmup_steps=10, total_steps=lambda: span[0])
    for _ in range(55):
        optimizer.step()
        scheduler.step()
    halfway = optimizer.param_groups[0]["lr"]
    span[0] = 1000
    optimizer.step()
    scheduler.step()
    assert halfway == pytest.approx(0.55, abs=0.02) and optimizer.param_groups[0]["lr"] > 0.95
