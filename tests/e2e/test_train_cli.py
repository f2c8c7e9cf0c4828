"""``poise train`` end to end: the real CLI, torch's elastic launcher, two gloo workers."""

from __future__ import annotations

import itertools
import json
import platform
import statistics
from pathlib import Path

import pytest

from poise import config as cfg
from tests.conftest import ROOT, run_poise
from tests.harness import run_cli

pytestmark = pytest.mark.e2e

REPORT_KEYS = {
    "task", "world_size", "steps", "wall_s", "throughput_samples_per_s", "throughput_tokens_per_s",
    "balance", "idle_fraction", "comm_fraction", "bytes_communicated_per_step", "eval_loss",
    "eval_accuracy", "per_rank", "config", "comm_overlap", "comm_busy_s_per_step", "comm_exposed_s_per_step",
}
QUIET = ("--diagnostics.progress", "false")


def _report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert REPORT_KEYS <= report.keys()
    for name in ("config.toml", "trace.json"):
        assert (out / name).is_file()
    return report


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digits")
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--steps", "60", "--out", str(out), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval accuracy" in proc.stdout  # the summary table
    return out


def test_digits_trains_to_a_sound_accuracy(digits_run):
    report = _report(digits_run)
    assert report["world_size"] == 2 and report["steps"] == 60
    assert report["eval_accuracy"] >= 0.95
    assert report["train_loss_last"] < report["train_loss_first"]
    assert len(report["per_rank"]) == 2
    # balance: the mean over the steps after the first of 1 - (max - min) / max of the ranks' compute
    assert len(report["balance_per_step"]) == 60
    assert report["balance"] == pytest.approx(statistics.fmean(report["balance_per_step"][1:]))
    if platform.libc_ver()[0] == "glibc":  # CPU training keeps freed memory by default
        assert [m["kept"] for m in report["memory"]] == [True, True]
        assert all(m["resident_mb"] > 0 and m["peak_resident_mb"] >= m["resident_mb"] and m["model_state_mb"] > 0
                   for m in report["memory"])
    assert report["bytes_communicated_per_step"] > 0
    assert 0.0 <= report["comm_overlap"] <= 1.0 and report["comm_busy_s_per_step"] > 0
    assert (digits_run / "timeline.png").stat().st_size > 1000
    trace = json.loads((digits_run / "trace.json").read_text())
    tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1}


def test_plain_torchrun_runs_the_same_worker(digits_run, tmp_path):
    config = cfg.load(digits_run / "config.toml")
    data = cfg.to_dict(config)
    data["out_dir"] = str(tmp_path)
    data["train"]["steps"] = 5
    path = cfg.save(cfg.from_dict(data), tmp_path / "config.toml")
    proc = run_cli(["--standalone", "--nproc-per-node=2", "-m", "poise.train.worker", "--config", str(path)],
                   cwd=ROOT, timeout_s=180, program="torchrun")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _report(tmp_path)["steps"] == 5


def test_code_lm_short_run(tmp_path, cache_dir):
    """The default balance (auto, said out loud: run_poise pins static otherwise) with a token
    budget: the run says what poise decided and on what figures."""
    proc = run_poise(
        "train", "--task", "code-lm", "--nproc", "2", "--steps", "8", "--max-seq-len", "128",
        "--batch-tokens", "1024", "--task.eval_max_samples", "64", "--task.cache_dir", str(cache_dir),
        "--diagnostics.gather_every_steps", "3", "--balance", "auto", "--out", str(tmp_path), *QUIET,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    assert report["steps"] == 8 and report["balance_strategy"] == "auto"
    balance = next(d for d in report["decisions"] if d["knob"] == "balance")
    assert balance["by"] == "poise" and "DDP's steps" in balance["choice"]
    # re-planned after every step from step 2; a move's trial steps (as many as the measured
    # speeds call for) are judged but not recorded, so only the order is fixed, not the count
    steps = [r["step"] for r in report["replans"]]
    assert report["replan_s"] >= 0 and steps[0] == 2 and steps == sorted(set(steps)) and steps[-1] <= 8, steps
    assert report["loss_unit"] == "bits/byte"
    assert 0 < report["eval_loss"] < 8.5  # < 8 bits/byte + noise: better than uniform over 256
    # the real tokens of both ranks (the loss curve's last point) over the job's time in steps
    tokens, elapsed_s = report["loss_curve"][-1][0], report["elapsed_s_per_step"][-1]
    assert tokens > 0 and report["throughput_tokens_per_s"] == pytest.approx(tokens / elapsed_s)
    assert report["config"]["train"]["batch_tokens"] == 1024


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "cifar"], "task.name='cifar' is unknown: allowed are code-lm, digits"),
        (["--nproc", "0"], "dist.nproc=0 is invalid"),
        (["--nproc", "100000"], "dist.nproc=100000 is not sensible"),
        (["--batch-size", "-1"], "train.batch_size=-1 is invalid"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message):
    proc = run_poise("train", *argv, timeout_s=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_dynamic_balance_moves_work_off_a_slow_rank(tmp_path):
    proc = run_poise(
        "train", "--task", "digits", "--nproc", "2", "--steps", "40", "--batch-size", "32",
        "--balance", "dynamic", "--rank-speed", "1:0.5", "--balance.slowdown_method", "sleep",
        "--balance.cold_start_steps", "5", "--balance.window_steps", "20", "--balance.replan_every_steps", "5",
        "--out", str(tmp_path), *QUIET,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    assert report["balance_strategy"] == "dynamic"
    assert [(s["speed"], s["method"]) for s in report["emulated_slowdown"]] == [(1.0, "none"), (0.5, "sleep")]
    replans = report["replans"]
    assert [r["step"] for r in replans][:3] == [5, 10, 15]
    assert replans[-1]["shares"][0] > 0.55  # the slow rank now gets less (how much less depends on the noise)
    assert report["per_rank"][0]["median_samples"] > report["per_rank"][1]["median_samples"]


def test_cost_balance_with_token_budget_reports_padding(tmp_path, cache_dir):
    proc = run_poise(
        "train", "--task", "code-lm", "--nproc", "2", "--steps", "6", "--max-seq-len", "256",
        "--batch-tokens", "2048", "--balance", "cost", "--task.eval_max_samples", "32",
        "--task.cache_dir", str(cache_dir), "--out", str(tmp_path), *QUIET,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    assert report["balance_strategy"] == "cost"
    assert 0.0 <= report["padding_waste"] < 0.5
    assert report["ideal_tokens_per_s"] > 0 and 0 < report["throughput_vs_ideal"] <= 1.05


# torch-powersgd: rank 8 (the default) shrinks digits' small matrices about 1.5x
@pytest.mark.parametrize(("codec", "min_ratio"), [("sign", 20.0), ("torch-powersgd", 1.3)])
def test_train_with_a_gradient_codec(tmp_path, codec, min_ratio):
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--steps", "12", "--codec", codec,
                     "--out", str(tmp_path), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    assert report["codec"] == codec
    # 12 steps, warm-up 1: sign starts compressing (and freezes Adam's variance) after 2 steps
    assert report["compression_start_step"] == 2
    assert report["variance_frozen_after"] == (2 if codec == "sign" else None)
    assert report["compression_ratio"] >= min_ratio
    assert report["comm_wire_bytes_per_step"] < report["comm_raw_bytes_per_step"]
    assert report["train_loss_last"] < report["train_loss_first"]


def test_train_with_local_first_top_k(tmp_path):
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--steps", "12", "--codec", "topk",
                     "--comm.local_first", "true", "--out", str(tmp_path), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "uncompressed for the first 2 steps, local first" in proc.stderr
    report = _report(tmp_path)
    assert report["compression_ratio"] >= 20
    assert report["train_loss_last"] < report["train_loss_first"]


@pytest.mark.parametrize(("balance", "steps"), [("static", 11), ("cost", None)])
def test_epochs_mode_runs_whole_epochs(tmp_path, balance, steps):
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--epochs", "1", "--batch-size", "64",
                     "--balance", balance, "--out", str(tmp_path), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    if steps is not None:
        assert report["steps"] == steps  # 1437 samples // 2 ranks // 64 per batch
    else:  # the balanced sampler covers every sample of the epoch once
        assert report["loss_curve"][-1][0] == 1437


def test_periodic_evaluation_records_the_curve_and_stops_at_a_target_loss(tmp_path):
    """train.eval_every: each evaluation lands in eval_curve against the training seconds so
    far; train.stop_at_eval_loss ends the run at the first evaluation that reaches it."""
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--steps", "60", "--train.eval_every", "10",
                     "--train.stop_at_eval_loss", "1.0", "--out", str(tmp_path), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    curve = report["eval_curve"]
    assert report["stopped_at_eval_loss"] and report["steps"] == curve[-1]["step"] < 60
    assert [p["step"] for p in curve] == list(range(10, report["steps"] + 1, 10))
    assert all(p["loss"] > 1.0 for p in curve[:-1])  # it stopped at the first that reached it
    assert curve[-1]["loss"] == report["eval_loss"] <= 1.0
    assert all(a["train_s"] < b["train_s"] for a, b in itertools.pairwise(curve))
    assert "reached train.stop_at_eval_loss=1: stopping" in proc.stderr


def test_auto_codec_dry_runs_powersgd_and_keeps_what_it_chose(tmp_path):
    """comm.codec=auto: PowerSGD dry-run after the last uncompressed steps, then used or not on
    every rank by the predicted step; the steps after the choice show it in their bytes."""
    proc = run_poise("train", "--task", "digits", "--nproc", "2", "--steps", "20", "--codec", "auto",
                     "--comm.start_step", "6", "--comm.auto_trial_steps", "4", "--out", str(tmp_path), *QUIET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path)
    trial = report["codec_trial"]
    assert trial["start_step"] == 6 and trial["trial_steps"] == 4 and isinstance(trial["uses_codec"], bool)
    assert trial["uses_codec"] == (trial["codec_step_s"] * trial["margin"] < trial["uncompressed_step_s"])
    assert "comm.codec=auto: median step" in proc.stderr
    if trial["uses_codec"]:  # kept: judged by its compressed steps 7 to 9, kept or dropped from step 10
        assert trial["confirmed"] == (trial["measured_codec_step_s"] * trial["margin"] < trial["uncompressed_step_s"])
        assert trial["dropped_step"] == (None if trial["confirmed"] else 10)
    compressed = report["comm_wire_bytes_per_step"] < report["comm_raw_bytes_per_step"]  # the median step
    assert compressed == (trial["uses_codec"] and trial["dropped_step"] is None)


def test_a_dropped_auto_codec_trains_exactly_as_plain_ddp(tmp_path):
    """The dry runs change nothing: auto told to drop PowerSGD (a margin no codec meets) ends with
    plain DDP's losses, bit for bit, though it ran PowerSGD's reduction three times."""
    args = ("train", "--task", "digits", "--nproc", "2", "--steps", "12", *QUIET)
    auto = run_poise(*args, "--codec", "auto", "--comm.start_step", "5", "--comm.auto_margin", "1000",
                     "--out", str(tmp_path / "auto"))
    plain = run_poise(*args, "--codec", "none", "--out", str(tmp_path / "none"))
    assert auto.returncode == 0 and plain.returncode == 0, auto.stderr[-3000:] + plain.stderr[-3000:]
    auto_report, plain_report = _report(tmp_path / "auto"), _report(tmp_path / "none")
    assert auto_report["codec_trial"]["uses_codec"] is False and auto_report["codec_trial"]["codec_step_s"] > 0
    assert auto_report["loss_curve"] == plain_report["loss_curve"]
    assert auto_report["eval_loss"] == plain_report["eval_loss"]
