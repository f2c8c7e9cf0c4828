"""``poise bench parallel``: its flags (one line), the flags of each job, and the rows from
synthetic reports (no job runs)."""

from __future__ import annotations

import argparse

import pytest

from poise.bench import parallel


def _args(**changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parallel.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("runs", "ddp,fsdp,nope", "--runs"),
    ("runs", "fsdp", "must include ddp"),
    ("runs", "ddp,ddp", "--runs"),
    ("steps", 0, "--steps"),
    ("timeout_s", float("inf"), "--timeout-s"),
    ("extra_steps", float("nan"), "--extra-steps"),
    ("seed", -1, "--seed"),
    ("target", float("nan"), "--target"),
    ("procs_per_node", 1, "dp-pp"),
])
def test_a_bad_flag_is_one_line_naming_it(flag: str, value: object, says: str) -> None:
    with pytest.raises(ValueError) as info:
        parallel.parse(_args(**{flag: value}))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_ddp_runs_first_and_sets_no_target_for_itself() -> None:
    args = _args(runs="fsdp,ddp,hsdp-int8")
    assert parallel.parse(args) == ["ddp", "fsdp", "hsdp-int8"]
    command, flags = parallel.job("ddp", args, ["--task", "code-lm"], None)
    assert command == "train" and flags[flags.index("--steps") + 1] == "60"
    assert "--train.stop_at_eval_loss" not in flags and flags[-4:] == ["--parallel", "ddp", "--codec", "none"]


def test_other_runs_follow_ddps_schedule_and_stop_at_its_loss() -> None:
    args = _args()
    command, flags = parallel.job("hsdp-int8", args, ["--task", "code-lm"], 3.25)
    assert command == "train" and flags[flags.index("--steps") + 1] == "90"
    assert flags[flags.index("--train.schedule_steps") + 1] == "60"
    assert flags[flags.index("--train.stop_at_eval_loss") + 1] == "3.25"
    assert flags[flags.index("--codec") + 1] == "int8" and flags[flags.index("--cluster") + 1] == "2:2"


def test_dp_pp_is_a_pipeline_of_a_stage_per_worker_and_a_replica_per_node() -> None:
    command, flags = parallel.job("dp-pp", _args(nodes=2, procs_per_node=2),
                                  ["--task", "code-lm", "--batch-size", "16"], 3.0)
    assert command == "pipeline" and "--task" not in flags
    assert flags[flags.index("--batch-size") + 1] == "32"  # a replica's batch: a node's worth of samples
    assert flags[flags.index("--stages") + 1] == "2" and flags[flags.index("--dp") + 1] == "2"


def _report(loss: float, curve: list[tuple[float, float]], state: float, rss: float) -> dict[str, object]:
    return {"steps": 60, "eval_loss": loss, "balance": 0.97, "median_step_s": 1.0,
            "comm_inter_node_wire_bytes_per_step": 1e6,
            "eval_curve": [{"step": 10 * i, "train_s": s, "loss": v} for i, (s, v) in enumerate(curve)],
            "memory": [{"peak_resident_mb": rss, "model_state_mb": state}] * 2}


def test_rows_give_time_to_target_and_ratios_against_ddp() -> None:
    ddp = {"run": "ddp", **parallel.measure(_report(3.0, [(0, 5.0), (100, 3.0)], 400.0, 900.0), 3.0)}
    fsdp = {"run": "fsdp", **parallel.measure(_report(2.9, [(0, 5.0), (40, 3.5), (60, 2.5)], 100.0, 600.0), 3.0)}
    missed = {"run": "hsdp", **parallel.measure(_report(3.4, [(0, 5.0), (90, 3.4)], 200.0, 700.0), 3.0)}
    rows = [ddp, fsdp, missed]
    parallel.summarize(rows)
    assert ddp["speedup_vs_ddp"] == pytest.approx(1.0)
    assert fsdp["time_to_target_s"] == pytest.approx(50.0) and fsdp["speedup_vs_ddp"] == pytest.approx(2.0)
    assert fsdp["state_vs_ddp"] == pytest.approx(0.25) and fsdp["rss_vs_ddp"] == pytest.approx(600 / 900)
    assert missed["time_to_target_s"] is None and missed["speedup_vs_ddp"] is None
