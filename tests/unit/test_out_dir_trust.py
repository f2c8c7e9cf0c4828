"""Files in a job's output directory and settings that a job took on trust (issue 57, items 14,
15, 17, 19, 20): each is refused in one line with exit 2 before anything trains or is
truncated, or made harmless."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poise import config as cfg
from poise.checkpoint import directory
from poise.cli import main
from poise.cli.train import JOB_LOCK
from poise.train.samples import keep_steps_before, record_problem
from tests.bounded import refused_in_one_line, run_bounded


def _train(out: Path, *flags: str) -> int:
    return main(["train", "--task", "digits", "--steps", "1", "--out", str(out), *flags])


# -- item 15: a symlinked sample record --------------------------------------------------------


def test_a_symlinked_sample_record_is_refused_and_its_target_kept(tmp_path, capsys):
    out, target = tmp_path / "out", tmp_path / "precious.txt"
    (out / "samples").mkdir(parents=True)
    target.write_text("x" * 21_000)
    (out / "samples" / "rank-00000.jsonl").symlink_to(target)
    assert _train(out, "--overwrite", "--diagnostics.record_samples", "true") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("poise train: error: sample record ") \
        and "rank-00000.jsonl' is a symbolic link" in err[0], err
    assert target.stat().st_size == 21_000
    with pytest.raises(ValueError, match="is a symbolic link"):  # the worker's own check, behind the command's
        keep_steps_before(out / "samples" / "rank-00000.jsonl", 0)
    assert target.stat().st_size == 21_000


def test_a_samples_folder_that_is_a_link_is_named(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "samples").symlink_to(tmp_path / "elsewhere")
    assert record_problem(tmp_path).endswith("samples' is a symbolic link")


# -- item 14: characters outside the Basic Multilingual Plane in a setting ---------------------


def test_a_config_with_an_emoji_in_its_paths_and_strings_reads_back_as_written(tmp_path):
    out = tmp_path / "runs \U0001f680 é"
    cache = str(tmp_path / "c\U0001f600\"\\")
    config = cfg.from_dict({"out_dir": str(out), "task": {"name": "digits", "cache_dir": cache},
                            "checkpoint": {"dir": str(tmp_path / "ck\U0001f9ea")}})
    path = cfg.save(config, tmp_path / "config.toml")
    assert (tmp_path / "config.toml").read_bytes().isascii()
    back = cfg.load(path)  # what every worker does first
    assert back == config and cfg.config_hash(back) == cfg.config_hash(config)


def test_a_path_that_is_not_utf8_is_named_in_one_line(tmp_path):
    config = cfg.from_dict({"out_dir": str(tmp_path / "bad\udcff"), "task": {"name": "digits"}})
    with pytest.raises(ValueError, match=r"^out_dir: .* holds bytes that are not UTF-8 text"):
        cfg.save(config, tmp_path / "config.toml")


# -- item 17: a replay file that is no report --------------------------------------------------


def _replay(path: str) -> int:
    return main(["train", "--task", "digits", "--steps", "1", "--balance.strategy", "dynamic",
                 "--balance.replay", path])


@pytest.mark.parametrize("make", ["dev-zero", "fifo", "5000-digit-step", "4000-digit-step", "huge-share"])
def test_a_replay_file_that_is_no_report_is_refused_in_one_line_before_launch(tmp_path, make):
    path = tmp_path / "report.json"
    if make == "dev-zero":
        path = Path("/dev/zero")
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "huge-share":
        path.write_text(json.dumps({"replans": [{"step": 3, "shares": [10**400, 1]}]}))
    else:
        digits = int(make.split("-")[0])
        path.write_text('{"replans": [{"step": ' + "9" * digits + ', "shares": [1, 1]}]}')
    outcome = run_bounded(_replay, str(path), memory_bytes=512 << 20, timeout_s=30)
    assert outcome.kind == "ok" and refused_in_one_line(outcome, "poise train: error: balance.replay="), \
        outcome.describe()


# -- item 19: the output directory's lock file ------------------------------------------------


@pytest.mark.timeout(60)
def test_a_fifo_named_as_the_lock_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / JOB_LOCK)
    assert _train(out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"poise train: error: output directory {str(out)!r}: its lock {JOB_LOCK} is not a regular file: "
                   "remove it, or give another --out"], err


@pytest.mark.timeout(60)
def test_a_held_locks_holder_text_reaches_the_user_without_escape_codes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os
fd = os.open({str(out / JOB_LOCK)!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, b"\\x1b]0;owned\\x07\\x1b[2Jhost h pid 1", 0)
print("held", flush=True)
import time; time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError) as err:
            directory.lock(out, wait_s=0.0, name=JOB_LOCK, what="output directory", flag="--out")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    message = str(err.value)
    assert "\x1b" not in message and "\x07" not in message and "?]0;owned??[2Jhost h pid 1" in message, message


# -- item 20: settings checked only in the workers, and help cut short -------------------------


def test_frozen_and_lr_are_checked_by_the_command_in_one_short_line(capsys):
    with pytest.raises(ValueError, match=r"^train.frozen='aaaa.{56}'\.\.\. is invalid: 900000 characters") as err:
        cfg.from_dict({"task": {"name": "digits"}, "train": {"frozen": "a" * 900_000}})
    assert len(str(err.value)) < 300
    with pytest.raises(ValueError, match=r"^train.frozen='0,x;rm' is invalid: 'x;rm' is not a parameter-name prefix"):
        cfg.from_dict({"task": {"name": "digits"}, "train": {"frozen": "0,x;rm"}})
    assert cfg.from_dict({"train": {"frozen": "blocks.0, token_embedding,4."}}).train.frozen_prefixes() == (
        "blocks.0", "token_embedding", "4.")
    assert main(["train", "--task", "digits", "--lr", "1e308"]) == 2
    assert capsys.readouterr().err.strip() == ("poise train: error: train.lr=1e+308 is invalid: allowed is above 0 and "
                                               "at most 10 (AdamW's peak learning rate; runs use 1e-4..1e-2)")
    assert cfg.from_dict({"train": {"lr": 10.0}}).train.lr == 10.0


@pytest.mark.parametrize("family", ["faults", "parallel"])
def test_bench_help_gives_the_whole_first_paragraph_as_plain_text(family, capsys):
    with pytest.raises(SystemExit):
        main(["bench", family, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    first = re.split(r" (?:options|positional arguments): ", text)[0].split("] ")[-1]  # after the usage lines
    assert first.startswith(f"poise bench {family}: ") and first.endswith(".") and "`" not in first, first
