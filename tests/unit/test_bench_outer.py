"""``poise bench outer``: its flags (one line, exit 2), the flags of each job, and the rows and
table from synthetic reports (no job runs)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from poise.bench import outer
from poise.cli import main
from poise.cli.flags import add_config_flags, resolve


def _args(**changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    outer.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("links", "1gbit,fast", "'fast'"),
    ("links", " , ", "--links"),
    ("links", "1gbit,1gbit", "must not repeat"),
    ("runs", "ddp,diloco,nope", "unknown nope"),
    ("runs", "diloco", "must include ddp"),
    ("runs", "ddp,ddp", "repeats"),
    ("seeds", "0,x", "--seeds"),
    ("seeds", "-1", "--seeds"),
    ("seeds", "1,1", "--seeds"),
    ("steps", 0, "--steps"),
    ("timeout_s", float("inf"), "--timeout-s"),
    ("extra_steps", -0.5, "--extra-steps"),
    ("extra_steps", float("nan"), "--extra-steps"),
])
def test_a_bad_flag_is_one_line_naming_it(flag: str, value: object, says: str) -> None:
    with pytest.raises(ValueError) as info:
        outer.parse(_args(**{flag: value}))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_refuses_with_exit_2_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "outer", "--runs", "ddp,nope", "--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("poise bench: error: --runs: unknown nope") and "\n" not in err


def test_variants_put_a_shaped_link_first_then_the_floor_then_the_slow_ones() -> None:
    variants, labels, plan = outer.parse(_args(links="floor,100mbit", slow_links="1gbit", runs="diloco,ddp",
                                               seeds="2,0", short_links=""))
    assert variants == [("100mbit", False), ("floor", False), ("1gbit", True)]
    assert labels == ["ddp", "diloco"] and plan.seeds == (2, 0) and plan.cluster == "2:2"


def test_short_links_run_ddp_briefly_after_a_full_link_sets_the_target() -> None:
    variants, _labels, plan = outer.parse(_args(links="100mbit,1gbit", runs="ddp,local-sgd", short_steps=7,
                                                slow_links=""))
    assert variants == [("1gbit", False), ("100mbit", False)] and plan.short_links == ("100mbit",)
    flags = outer.job_flags("ddp", "100mbit", False, 0, outer.realistic(), plan, None)
    assert flags[flags.index("--steps") + 1] == "7"
    flags = outer.job_flags("local-sgd", "100mbit", False, 0, outer.realistic(), plan, 3.0)
    assert flags[flags.index("--steps") + 1] == str(round(plan.steps * (1 + plan.extra)))
    with pytest.raises(ValueError, match="covers every link"):
        outer.parse(_args(links="100mbit", runs="ddp"))


def test_job_flags_keep_the_reference_schedule_and_stop_at_its_loss() -> None:
    plan = outer.Plan("2:2", 200, 0.25, 10, (0,), 60.0)
    model = outer.realistic()
    assert model[model.index("--batch-size") + 1] == "16"
    ddp = outer.job_flags("ddp", "1gbit", False, 3, model, plan, None)
    assert ddp[ddp.index("--steps") + 1] == "200" and "--train.stop_at_eval_loss" not in ddp
    assert ddp[ddp.index("--seed") + 1] == "3" and ddp[ddp.index("--link") + 1] == "1gbit"
    slow = outer.job_flags("torch-localsgd", "floor", True, 0, model, plan, 2.5)
    assert slow[slow.index("--steps") + 1] == "250" and slow[slow.index("--link") + 1] == outer.FLOOR_RATE
    assert slow[slow.index("--train.schedule_steps") + 1] == "200"
    assert slow[slow.index("--train.stop_at_eval_loss") + 1] == "2.5"
    assert slow[slow.index("--rank-speed") + 1] == "1:0.5" and slow[slow.index("--sync") + 1] == "torch-localsgd"
    assert slow[slow.index("--cluster") + 1] == "2:2"


def _report(curve: list[tuple[int, float, float]], final: float, utilization: list[float],
            per_token: float) -> dict:
    return {"steps": curve[-1][0], "eval_loss": final, "wire_bytes_per_token": per_token,
            "per_rank": [{"rank": r, "compute_utilization": u} for r, u in enumerate(utilization)],
            "eval_curve": [{"step": s, "train_s": t, "loss": v} for s, t, v in curve]}


def test_measure_reads_the_report_time_to_target_utilization_per_worker_and_bytes_per_token() -> None:
    report = _report([(10, 10.0, 3.0), (20, 20.0, 2.0)], 2.0, [0.9, 0.45], 12.5)
    row = outer.measure(report, target=2.5)
    assert row["compute_utilization"] == [0.9, 0.45] and row["bytes_per_token"] == 12.5
    assert row["time_to_target_s"] == pytest.approx(15.0)  # halfway between 3.0 at 10 s and 2.0 at 20 s
    assert row["final_eval_loss"] == 2.0 and row["steps"] == 20
    at_steps = outer.measure(report, target=2.5, reference_steps=10)
    assert at_steps["train_s_at_reference_steps"] == 10.0 and at_steps["eval_loss_at_reference_steps"] == 3.0
    assert outer.measure(report, target=1.0)["time_to_target_s"] is None  # not reached
    assert outer.measure(report, target=None)["time_to_target_s"] is None  # no reference yet


def _run(run: str, link: str, seed: int, time_s: float | None, util: list[float], slow: bool = False) -> dict:
    """A run whose eval loss falls linearly from 3.0 at 0 s to 2.0 (the target) at ``time_s``,
    or to 2.1 at 200 s where it never reached the target."""
    final = 2.0 if time_s else 2.1
    return {"run": run, "link": link, "slow": slow, "seed": seed, "steps": 200, "time_to_target_s": time_s,
            "target_eval_loss": 2.0, "final_eval_loss": final, "compute_utilization": util,
            "bytes_per_token": 100.0, "train_s": time_s or 200.0,
            "eval_curve": [{"step": 0, "train_s": 0.0, "loss": 3.0}, {"step": 200, "train_s": time_s or 200.0,
                                                                       "loss": final}]}


def test_rows_are_medians_over_seeds_with_ratios_at_the_same_link() -> None:
    runs = [_run("ddp", "1gbit", s, t, [0.5, 0.5]) for s, t in ((0, 100.0), (1, 120.0), (2, 110.0))]
    runs += [_run("torchft-diloco", "1gbit", s, t, [0.8, 0.6]) for s, t in ((0, 80.0), (1, None), (2, 60.0))]
    runs += [_run("diloco", "1gbit", s, t, [0.9, u]) for s, t, u in ((0, 50.0, 0.95), (1, 55.0, 0.9), (2, 40.0, 1.0))]
    runs += [_run("diloco", "floor", s, 45.0, [1.0, 1.0]) for s in (0, 1, 2)]
    runs += [{"run": "torchft-diloco", "link": "floor", "slow": False, "seed": 0, "error": "failed"}]
    rows = {(r["link"], r["run"]): r for r in outer.summarize(runs)}
    diloco, torchft = rows["1gbit", "diloco"], rows["1gbit", "torchft-diloco"]
    assert torchft["time_to_target_s"] == 80.0  # not reached counts as slowest: median of 60, 80, never
    assert diloco["time_to_target_s"] == 50.0 and diloco["speedup_vs_ddp"] == pytest.approx(110.0 / 50.0)
    # at torchft's own final loss, seed by seed: 80/50 (2.0), 200/49.5 (2.1, reached at 0.9 of 55 s), 60/40
    assert diloco["speedup_vs_torchft_diloco"] == pytest.approx(80.0 / 50.0) and diloco["torchft_loss"] == 2.0
    assert diloco["torchft_reference"] == "torchft-diloco"
    assert diloco["floor_ratio"] == pytest.approx(50.0 / 45.0) and rows["floor", "diloco"]["floor_ratio"] is None
    assert diloco["compute_utilization"] == [0.9, 0.95] and diloco["min_compute_utilization"] == 0.9
    assert ("floor", "torchft-diloco") not in rows  # a failed job is no row
    assert rows["1gbit", "ddp"]["speedup_vs_torchft_diloco"] == pytest.approx(80.0 / 100.0)  # 0.8, 200/108, 60/110


def test_rows_give_the_speed_at_equal_steps_and_the_spread_over_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for seed, (ddp_s, run_s, loss) in enumerate(((100.0, 60.0, 2.3), (120.0, 70.0, 2.2), (110.0, 80.0, 2.25))):
        runs += [{**_run("ddp", "1gbit", seed, ddp_s, [0.5]), "train_s_at_reference_steps": ddp_s,
                  "eval_loss_at_reference_steps": 2.0},
                 {**_run("local-sgd", "1gbit", seed, 90.0 if seed == 2 else None, [0.9]),
                  "train_s_at_reference_steps": run_s, "eval_loss_at_reference_steps": loss}]
    rows = {r["run"]: r for r in outer.summarize(runs)}
    local = rows["local-sgd"]
    assert local["train_s_at_reference_steps"] == 70.0 and local["train_s_at_reference_steps_range"] == [60.0, 80.0]
    assert local["speedup_at_equal_steps"] == pytest.approx(110.0 / 70.0)
    assert local["eval_loss_at_reference_steps_range"] == [2.2, 2.3] and local["eval_loss_at_reference_steps"] == 2.25
    assert local["reached"] == 1 and local["time_to_target_s"] is None  # one seed of three: the median never did
    assert local["time_to_target_range_s"] == [90.0, 90.0] and rows["ddp"]["reached"] == 3
    outer.show(list(rows.values()), outer.Plan("2:2", 200, 0.25, 10, (0, 1, 2), 60.0))
    shown = capsys.readouterr().out
    assert "70.0 (60.0-80.0) (1.57x)" in shown and "2.2500 (2.2000-2.3000)" in shown
    assert "not reached, 1/3 seeds" in shown and "median (min-max) of seeds 0,1,2" in shown


def test_a_run_that_never_reaches_torchfts_final_loss_has_no_speedup_against_it() -> None:
    runs = [_run("torchft-diloco", "1gbit", s, 80.0, [0.8]) for s in (0, 1, 2)]
    runs += [_run("local-sgd", "1gbit", s, t, [0.9]) for s, t in ((0, 40.0), (1, None), (2, None))]
    rows = {r["run"]: r for r in outer.summarize(runs)}
    assert rows["local-sgd"]["speedup_vs_torchft_diloco"] is None  # two of three seeds never reached 2.0
    assert rows["torchft-diloco"]["speedup_vs_torchft_diloco"] == pytest.approx(1.0)


def test_the_equivalent_stands_in_for_torchft_and_the_table_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run("ddp", "1gbit", 0, 100.0, [0.5]), _run(outer.EQUIVALENT, "1gbit", 0, 50.0, [0.9]),
            _run("diloco", "1gbit", 0, 40.0, [0.9], slow=True), _run("ddp", "1gbit", 0, None, [0.5], slow=True)]
    rows = outer.summarize(runs)
    fast = next(r for r in rows if r["run"] == "ddp" and not r["slow"])
    assert fast["torchft_reference"] == outer.EQUIVALENT and fast["speedup_vs_torchft_diloco"] == 0.5
    slow = next(r for r in rows if r["run"] == "diloco")
    assert slow["speedup_vs_ddp"] is None and slow["speedup_vs_torchft_diloco"] is None  # no reference there
    outer.show(rows, outer.Plan("2:2", 200, 0.25, 10, (0,), 60.0))
    shown = capsys.readouterr().out
    assert "vs diloco-as-torchft" in shown and "torchft's behaviour" in shown
    assert "half speed" in shown and "not reached" in shown


@pytest.mark.parametrize(("label", "mode", "codec"), [("local-sgd-node", "local_sgd", "none"),
                                                      ("diloco-node", "diloco", "none"),
                                                      ("streaming-int8-node", "streaming", "int8")])
def test_node_runs_are_their_rank_runs_with_a_node_as_one_replica(label: str, mode: str, codec: str) -> None:
    """Each ``-node`` run resolves, through ``poise train``'s own flags, to its rank-scope run's
    settings with ``sync.inner_scope=node``, and ``--runs`` accepts it."""
    plan = outer.Plan("2:2", 200, 0.25, 10, (0,), 60.0)
    configs = {}
    for run in (label, label.removesuffix("-node")):
        parser = argparse.ArgumentParser()
        add_config_flags(parser)
        configs[run] = resolve(parser.parse_args(outer.job_flags(run, "1gbit", False, 0, outer.realistic(), plan, 3.0)))
    node, rank = configs[label], configs[label.removesuffix("-node")]
    assert (node.sync.mode, node.sync.codec, node.sync.inner_steps) == (mode, codec, 5)
    assert node.sync.inner_scope == "node" and rank.sync.inner_scope == "rank"
    assert dataclasses.replace(node.sync, inner_scope="rank") == rank.sync and node.balance == rank.balance
    _variants, labels, _plan = outer.parse(_args(runs=f"ddp,{label}"))
    assert labels == ["ddp", label] and label not in outer.DEFAULT_RUNS
