"""``[parallel]`` (``--parallel fsdp|hsdp``): the section's checks, its cross-section refusals, the
flags, and the pure rules of what ``poise train`` shards (poise/train/shard.py)."""

from __future__ import annotations

import argparse

import pytest
from torch import nn

from poise import config as cfg
from poise.cli import build_parser
from poise.cli.flags import resolve
from poise.cli.train import check_parallel
from poise.tasks.code_lm import ByteTransformer
from poise.tasks.digits import DigitsCNN
from poise.train.shard import mesh_layout, shard_units


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_flags_set_the_section():
    c = resolve(parse("--parallel", "hsdp", "--parallel.shard_size", "2", "--parallel.reshard_after_forward", "false",
                      "--nproc", "4"))
    assert c.parallel == cfg.ParallelConfig(mode="hsdp", shard_size=2, reshard_after_forward=False)
    assert c.parallel.sharded and c.parallel.shard_group(4) == 2
    assert cfg.RunConfig().parallel.mode == "ddp" and not cfg.RunConfig().parallel.sharded
    assert cfg.ParallelConfig(mode="hsdp").shard_group(3) == 3  # unset: one group per machine


def test_the_section_round_trips_through_toml(tmp_path):
    c = resolve(parse("--parallel", "fsdp", "--parallel.reshard_after_forward", "false"))
    assert cfg.load(cfg.save(c, tmp_path / "config.toml")) == c


@pytest.mark.parametrize(("argv", "needle"), [
    (["--parallel", "zero3"], "parallel.mode='zero3' is unknown: allowed are ddp, fsdp, hsdp, dp-pp"),
    (["--parallel", "hsdp", "--parallel.shard_size", "0"], "parallel.shard_size=0 is outside 1..100000"),
    (["--parallel", "fsdp", "--parallel.shard_size", "2"],
     "parallel.shard_size=2 only applies to parallel.mode='hsdp'"),
    (["--parallel", "hsdp", "--parallel.shard_size", "3", "--nproc", "4"],
     "parallel.shard_size=3 does not divide the job's 4 ranks"),
    (["--parallel", "hsdp", "--nproc", "2", "--nnodes", "3", "--parallel.shard_size", "4"],
     "parallel.shard_size=4 does not divide the job's 6 ranks"),
    (["--parallel", "fsdp", "--straggler", "deadline"], "it needs straggler.mode=off (not 'deadline')"),
    (["--parallel", "fsdp", "--delay", "slow:rank=1,x=0.2"], "no emulate.delay"),
    (["--parallel", "hsdp", "--sync", "diloco"], "it needs sync.mode='step' (not 'diloco')"),
    (["--parallel", "fsdp", "--sync", "auto"], "it needs sync.mode='step' (not 'auto')"),
    (["--parallel", "fsdp", "--codec", "topk", "--comm.local_first", "true"],
     "parallel.mode='fsdp' with comm.local_first"),
    (["--parallel", "fsdp", "--train.accum_steps", "2", "--checkpoint-every", "3"],
     "checkpoint.every_steps=3 is not a multiple of train.accum_steps=2"),
])
def test_bad_settings_fail_in_one_line(argv, needle):
    with pytest.raises(ValueError) as info:
        resolve(parse(*argv))
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message


def test_sharded_modes_accept_what_they_support():
    resolve(parse("--parallel", "fsdp", "--train.accum_steps", "2", "--checkpoint-every", "4"))
    resolve(parse("--parallel", "hsdp", "--nproc", "2", "--nnodes", "2"))  # one group per machine
    resolve(parse("--parallel", "hsdp", "--cluster", "2:2", "--codec", "int8"))
    resolve(parse("--parallel", "ddp", "--straggler", "deadline"))  # DDP keeps everything it had


def test_poise_train_points_dp_pp_to_poise_pipeline():
    check_parallel(resolve(parse("--parallel", "fsdp")))
    with pytest.raises(ValueError, match=r"parallel.mode='dp-pp' is data x pipeline parallelism: run it with "
                                         r"`poise pipeline`"):
        check_parallel(resolve(parse("--parallel", "dp-pp")))


@pytest.mark.parametrize(("argv", "needle"), [
    (["--parallel", "fsdp", "--codec", "torch-fp16"], "comm.codec='torch-fp16' runs on DDP only"),
    (["--parallel", "hsdp", "--codec", "auto"], "comm.codec='auto' runs on DDP only"),
    (["--parallel", "fsdp", "--codec", "powersgd"], "use parallel.mode=hsdp"),
    (["--parallel", "hsdp", "--collective", "ring"], "comm.collective='ring' with parallel.mode='hsdp'"),
])
def test_poise_train_refuses_what_only_ddp_runs_before_starting_workers(argv, needle):
    with pytest.raises(ValueError) as info:
        check_parallel(resolve(parse(*argv)))
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv", [("--parallel", "fsdp", "--codec", "int8"),
                                  ("--parallel", "hsdp", "--codec", "powersgd"),
                                  ("--parallel", "ddp", "--codec", "auto", "--collective", "ring")])
def test_poise_train_takes_what_the_sharded_strategy_runs(argv):
    check_parallel(resolve(parse(*argv)))


def test_units_are_a_transformers_blocks():
    model = ByteTransformer(max_seq_len=16, d_model=8, num_layers=3, num_heads=2)
    assert shard_units(model) == ["blocks.0", "blocks.1", "blocks.2"]


def test_units_without_a_module_list_are_the_top_level_children_with_parameters():
    assert shard_units(DigitsCNN()) == ["features", "classifier"]
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert shard_units(model) == ["0", "2"]
    assert shard_units(nn.Linear(2, 2)) == []  # the root alone


def test_units_come_from_the_largest_module_list_and_skip_empty_children():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.body = nn.Sequential(nn.ModuleList([nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)]))
            self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # no parameters: never a unit

    assert shard_units(Net()) == ["body.0.0", "body.0.2"]


def test_units_are_siblings_so_no_parameter_is_in_two():
    model = ByteTransformer(max_seq_len=16, d_model=8, num_layers=2, num_heads=2)
    units = shard_units(model)
    owned = [id(p) for name in units for p in model.get_submodule(name).parameters()]
    assert len(owned) == len(set(owned))


def test_mesh_layouts():
    fsdp = mesh_layout(cfg.ParallelConfig(mode="fsdp"), "none", 4, 2)
    assert (fsdp.shape, fsdp.names, fsdp.shard_only) == ((4,), ("shard",), False)
    hsdp = mesh_layout(cfg.ParallelConfig(mode="hsdp"), "bf16", 4, 2)
    assert (hsdp.shape, hsdp.names, hsdp.shard_only) == ((2, 2), ("replicate", "shard"), False)
    # a codec FSDP2's replicate all-reduce cannot run: poise runs it, the model is sharded on 'shard' only
    assert mesh_layout(cfg.ParallelConfig(mode="hsdp"), "powersgd", 4, 2).shard_only
    assert mesh_layout(cfg.ParallelConfig(mode="hsdp", shard_size=4), "int8", 8, 2).shape == (2, 4)
    with pytest.raises(ValueError, match=r"parallel\.shard_size=4 does not divide the job's 6 ranks"):
        mesh_layout(cfg.ParallelConfig(mode="hsdp", shard_size=4), "none", 6, 2)
    with pytest.raises(ValueError, match=r"parallel\.mode='ddp' does not shard the model"):
        mesh_layout(cfg.ParallelConfig(), "none", 2, 2)
