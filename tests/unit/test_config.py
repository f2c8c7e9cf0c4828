import argparse

import pytest

from poise import config as cfg
from poise.cli import build_parser
from poise.cli.flags import resolve


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_defaults_are_valid_and_round_trip_through_toml(tmp_path):
    c = cfg.RunConfig()
    path = cfg.save(c, tmp_path / "config.toml")
    assert cfg.load(path) == c
    assert c.total_steps == 100


def test_precedence_defaults_file_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nsteps = 7\nlr = 0.5\n[task]\nname = "digits"\n')
    c = resolve(parse("--config", str(f), "--lr", "0.25", "--dist.timeout_s", "9"))
    assert c.task.name == "digits"  # from the file
    assert c.train.steps == 7  # from the file
    assert c.train.lr == 0.25  # flag beats file
    assert c.dist.timeout_s == 9.0  # generic --section.field flag
    assert c.train.weight_decay == 0.01  # default


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--task", "imagenet"], "task.name='imagenet' is unknown: allowed are code-lm, digits"),
        (["--steps", "0"], "train.steps=0"),
        (["--batch-size", "-3"], "train.batch_size=-3"),
        (["--steps", "abc"], "train.steps='abc' is not a valid int"),
        (["--nproc", "500"], "dist.nproc=500 is not sensible"),
        (["--steps", "5", "--epochs", "2"], "give one"),
        (["--task", "digits", "--batch-tokens", "4096"], "only applies to task code-lm"),
        (["--batch-tokens", "100"], "below task.max_seq_len"),
        (["--task.d_model", "100", "--task.num_heads", "3"], "not divisible"),
        (["--nnodes", "0"], "dist.nnodes='0'"),
        (["--dist.start_method", "spawn"], "dist.start_method='spawn' is unknown: allowed are auto, fork, subprocess"),
        (["--balance", "magic"], "balance.strategy='magic' is unknown: allowed are auto, static, cost, dynamic"),
        (["--rank-speed", "1:1.5"], "speed '1.5' of rank 1 is outside [0.01, 1]"),
        (["--rank-speed", "fast"], "balance.rank_speed item 'fast' is invalid"),
        (["--balance.window_steps", "10"], "balance.window_steps=10 is outside the allowed 20-100"),
        (["--balance.max_share_change", "0"], "balance.max_share_change=0.0 is outside (0, 1]"),
        (["--balance.max_share_change", "1.5"], "balance.max_share_change=1.5 is outside (0, 1]"),
        (["--codec", "zip"], "comm.codec='zip' is unknown: allowed are none, fp16"),
        (["--topk-ratio", "0"], "comm.topk_ratio=0.0 is outside (0, 1]"),
        (["--bucket-mb", "0"], "comm.bucket_mb=0.0 is invalid"),
        (["--comm.local_first", "true"], "comm.local_first needs a poise codec with error feedback"),
        (["--codec", "torch-powersgd", "--comm.local_first", "true"], "codec='torch-powersgd'"),
        (["--codec", "topk", "--no-error-feedback", "--comm.local_first", "true"], "error_feedback=False"),
        (["--codec", "topk", "--collective", "hierarchical", "--comm.local_first", "true"],
         "collective='hierarchical'"),
        (["--checkpoint.delta_codec", "zip"], "checkpoint.delta_codec='zip' is unknown: allowed are exact, fp16"),
        (["--train.schedule_steps", "0"], "train.schedule_steps"),
        (["--codec", "auto", "--comm.auto_trial_steps", "1"], "comm.auto_trial_steps=1 must be >= 2"),
    ],
)
def test_bad_values_give_one_line_errors(argv, needle):
    with pytest.raises(ValueError) as info:
        resolve(parse(*argv))
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_switches_turn_booleans_on_and_off():
    assert resolve(parse("--no-error-feedback")).comm.error_feedback is False
    assert resolve(parse("--no-error-feedback", "--error-feedback")).comm.error_feedback is True
    assert resolve(parse("--codec", "sign", "--topk-ratio", "0.1")).comm.topk_ratio == 0.1


def test_unknown_keys_in_file_are_rejected(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ValueError, match=r"unknown setting train.stepz: allowed in \[train\] are steps"):
        resolve(parse("--config", str(f)))
    f.write_text("[trian]\nsteps = 3\n")
    with pytest.raises(ValueError, match="unknown setting 'trian'"):
        resolve(parse("--config", str(f)))


def test_wrong_types_and_broken_files(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ValueError, match=r"train\.steps='many' is not a valid int"):
        resolve(parse("--config", str(f)))
    f.write_text("[train\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        resolve(parse("--config", str(f)))
    with pytest.raises(ValueError, match="does not exist"):
        resolve(parse("--config", str(tmp_path / "missing.toml")))


def test_hash_tracks_every_setting():
    a = cfg.RunConfig()
    b = cfg.from_dict({"train": {"seed": 1}})
    assert cfg.config_hash(a) == cfg.config_hash(cfg.RunConfig())
    assert cfg.config_hash(a) != cfg.config_hash(b)
