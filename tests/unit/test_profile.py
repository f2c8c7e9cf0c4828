"""Layer profiling: the numbers it reports are the layers' real sizes, and the user's layers stay untouched."""

import pytest
import torch
from torch import nn

from poise.balance.profile import LayerProfile, named_layers, profile_layers
from poise.tasks.code_lm import ByteTransformer


def test_sequential_profile_reports_exact_sizes_and_leaves_layers_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    before = [p.detach().clone() for p in model.parameters()]
    prof = profile_layers(model, torch.randn(4, 16), repeats=2, warmup=1)
    assert prof.names == ["Linear", "ReLU", "Linear"]
    assert prof.param_bytes == [(16 * 32 + 32) * 4, 0, (32 * 8 + 8) * 4]
    assert prof.output_bytes == [4 * 32 * 4, 4 * 32 * 4, 4 * 8 * 4]
    assert prof.boundary_bytes == [4 * 32 * 4, 4 * 32 * 4]
    # a linear layer keeps its input for the weight gradient (its weight is not an activation);
    # ReLU keeps its output
    assert prof.activation_bytes == [4 * 16 * 4, 4 * 32 * 4, 4 * 32 * 4]
    assert all(t > 0 for t in prof.time_s)
    assert all(f <= t for f, t in zip(prof.forward_s, prof.time_s, strict=True))
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.grad is None and torch.equal(p, b)


def test_code_lm_layers_with_the_loss_on_the_last_layer():
    model = ByteTransformer(max_seq_len=32, d_model=16, num_layers=2, num_heads=2)
    tokens = torch.randint(0, 256, (3, 31))
    targets = torch.randint(0, 256, (3, 31))
    layers = model.pipeline_layers()
    names = ["embedding", "block0", "block1", "head"]

    def loss(logits):
        return nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))

    prof = profile_layers(layers, tokens, names=names, loss_fn=loss, repeats=1, warmup=0)
    assert prof.names == names
    assert prof.param_bytes[0] == (256 + 32) * 16 * 4  # token and position tables
    assert prof.boundary_bytes == [3 * 31 * 16 * 4] * 3  # the residual stream crosses every cut
    assert prof.output_bytes[-1] == 3 * 31 * 256 * 4
    assert all(p.grad is None for p in model.parameters())
    assert prof.boundary_costs_s(1e6) == pytest.approx([2 * b / 1e6 for b in prof.boundary_bytes])
    memory = prof.memory_bytes(state_bytes_per_param_byte=3.0, micro_batches_in_flight=2)
    assert memory[1] == pytest.approx(prof.param_bytes[1] * 4 + prof.activation_bytes[1] * 2)
    assert LayerProfile(**prof.as_dict()) == prof  # travels as a plain dict (broadcast to ranks)


def test_pipeline_layers_compute_the_model_and_keep_its_state_dict():
    torch.manual_seed(0)
    model = ByteTransformer(max_seq_len=32, d_model=16, num_layers=3, num_heads=2)
    keys = set(model.state_dict())
    tokens = torch.randint(0, 256, (2, 20))
    assert torch.equal(nn.Sequential(*model.pipeline_layers())(tokens), model(tokens))
    assert set(model.state_dict()) == keys and "token_embedding.weight" in keys
    shared = {id(p) for layer in model.pipeline_layers() for p in layer.parameters()}
    assert shared == {id(p) for p in model.parameters()}


def test_named_layers_and_bad_input():
    model = ByteTransformer(max_seq_len=32, d_model=16, num_layers=2, num_heads=2)
    assert named_layers(model, ["blocks.0", "head"]) == [model.blocks[0], model.head]
    with pytest.raises(ValueError, match=r"no submodule 'blocks\.7'"):
        named_layers(model, ["blocks.7"])
    with pytest.raises(ValueError, match="at least one layer"):
        profile_layers([], torch.zeros(1))
    with pytest.raises(ValueError, match="repeats=0"):
        profile_layers([nn.ReLU()], torch.zeros(1), repeats=0)
    with pytest.raises(ValueError, match="link_bytes_per_s=0"):
        profile_layers([nn.ReLU(), nn.ReLU()], torch.zeros(1), repeats=1).boundary_costs_s(0)
