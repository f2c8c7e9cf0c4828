"""Every diagnosis rule on synthetic timelines: quiet on a clean table, loud on its own cause;
and the timeline file written by Session.finish read back and validated."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from poise.diagnostics import rules
from poise.diagnostics.run import RunData, load_run
from poise.diagnostics.timeline import FIELDS, OPTIONAL_FIELDS, TimelineFileError, column, load_table, save_table

RNG_SEED = 0


def make_table(ranks: int = 2, steps: int = 40, *, compute_s: float = 0.1, data_s: float = 0.001,
               comm_s: float = 0.005, speeds: tuple[float, ...] | None = None, work: np.ndarray | None = None,
               padded_per_real: float = 1.02, noise: float = 0.02,
               on_cpu: tuple[float, ...] | None = None) -> np.ndarray:
    """A plausible gathered table: every rank computes ``compute_s × work / speed`` per step,
    waits for the slowest, then communicates ``comm_s``; small noise from a fixed seed. Each
    rank's training thread is on a CPU for ``on_cpu`` of its compute (default 0.97)."""
    rng = np.random.default_rng(RNG_SEED)
    speeds = speeds or (1.0,) * ranks
    work = np.full((ranks, steps), 1000.0) if work is None else work
    table = np.zeros((ranks, steps, len(FIELDS)))
    col = {f: i for i, f in enumerate(FIELDS)}
    jitter = 1 + noise * rng.standard_normal((ranks, steps))
    compute = compute_s * work / 1000.0 / np.asarray(speeds)[:, None] * jitter
    slowest = compute.max(axis=0, keepdims=True)
    blocked = slowest - compute + comm_s
    table[:, :, col["step"]] = np.arange(steps)
    table[:, :, col["forward_s"]] = compute / 3
    table[:, :, col["backward_s"]] = compute * 2 / 3
    table[:, :, col["comm_wait_s"]] = blocked
    table[:, :, col["data_s"]] = data_s
    table[:, :, col["optim_s"]] = 0.002
    table[:, :, col["step_s"]] = data_s + compute + blocked + 0.002
    table[:, :, col["samples"]] = 8
    table[:, :, col["tokens"]] = work / padded_per_real
    table[:, :, col["padded_tokens"]] = work
    table[:, :, col["loss"]] = 2.0
    table[:, :, col["raw_bytes"]] = table[:, :, col["wire_bytes"]] = 2e6
    table[:, :, col["comm_busy_s"]] = comm_s
    table[:, :, col["compute_wall_s"]] = compute
    table[:, :, col["compute_cpu_s"]] = compute * np.asarray(on_cpu or (0.97,) * ranks)[:, None]
    table[:, :, col["cpu_s"]] = table[:, :, col["compute_cpu_s"]] + 0.003
    return table


def verdicts(run: RunData) -> dict[str, rules.Finding]:
    return {f.rule: f for f in rules.evaluate(run)}


def test_a_clean_table_is_ok_on_every_rule():
    found = verdicts(RunData(make_table(), {"balance_strategy": "cost"}))
    assert set(found) == set(rules.RULES)
    assert {f.verdict for f in found.values()} == {"ok"}, {k: f.summary for k, f in found.items()}


def test_straggler_is_named_with_its_score():
    found = verdicts(RunData(make_table(speeds=(1.0, 1.0, 0.5, 1.0), ranks=4), {"balance_strategy": "cost"}))
    f = found["straggler"]
    assert f.verdict == "problem" and f.rank == 2
    assert f.evidence["worst_score"] == pytest.approx(0.5, abs=0.03)
    assert "--balance dynamic" in f.advice
    mild = verdicts(RunData(make_table(speeds=(1.0, 0.8)), {}))["straggler"]
    assert mild.verdict == "warn" and mild.rank == 1


def test_data_skew_follows_the_work_handed_out_and_advises_cost_balancing():
    rng = np.random.default_rng(1)
    work = rng.uniform(300, 1700, size=(2, 60))  # static split of unequal samples
    f = verdicts(RunData(make_table(work=work, steps=60), {"balance_strategy": "static"}))["data_skew"]
    assert f.verdict == "problem", f.summary
    assert f.evidence["compute_follows_work_correlation"] > 0.9
    assert "--balance cost" in f.advice
    # the same idle from a slow rank does not follow the work: that is the straggler rule's
    slow = verdicts(RunData(make_table(speeds=(1.0, 0.6)), {}))
    assert slow["data_skew"].verdict == "ok" and slow["straggler"].verdict == "problem"


def test_input_pipeline_on_every_rank_and_on_one_rank():
    f = verdicts(RunData(make_table(data_s=0.06), {}))["input_pipeline"]
    assert f.verdict == "problem" and "num_workers" in f.advice
    table = make_table()
    table[1, :, FIELDS.index("data_s")] = 0.06
    one = verdicts(RunData(table, {}))["input_pipeline"]
    assert one.verdict == "warn" and one.rank == 1


def test_communication_share_with_the_line_rate():
    f = verdicts(RunData(make_table(comm_s=0.2), {"codec": "none"}, link_bit_per_s=20e6))["communication"]
    assert f.verdict == "problem"
    # 2 MB in 0.2 s on 2 ranks: busbw 80 Mbit/s, 4x a 20 Mbit/s link's line rate
    assert f.evidence["busbw_bit_per_s"] == pytest.approx(80e6, rel=1e-6)
    assert f.evidence["busbw_vs_line_rate"] == pytest.approx(4.0, rel=1e-3)
    assert "saturated" in f.advice and "--codec" in f.advice
    warn = verdicts(RunData(make_table(comm_s=0.025), {}))["communication"]
    assert warn.verdict == "warn" and "busbw" in warn.advice


@pytest.mark.parametrize(("sync", "named", "not_named"), [
    ({"mode": "step"}, ["--collective hierarchical", "--bucket-mb"], ["--parallel"]),
    ({"mode": "fsdp"}, ["--parallel hsdp", "--parallel.shard_size", "reshard_after_forward"], ["--bucket-mb"]),
    ({"mode": "hsdp", "native": True}, ["fp16 or bf16", "mesh['shard']"], ["--bucket-mb", "--collective"]),
    ({"mode": "hsdp", "native": False}, ["powersgd"], ["--bucket-mb", "mesh['shard']"]),
    ({"mode": "auto: diloco"}, ["--sync.inner_steps", "--sync.codec"], ["--bucket-mb", "--codec fp16"]),
    ({"mode": "torchft-diloco"}, ["--sync.inner_steps"], ["--bucket-mb"]),
    ("garbage", ["--bucket-mb"], []),  # not a sync summary: DDP's advice
])
def test_communication_advice_names_the_knobs_of_the_run_s_synchronization(sync, named, not_named):
    advice = verdicts(RunData(make_table(comm_s=0.2), {"codec": "int8", "sync": sync}))["communication"].advice
    assert all(name in advice for name in named), advice
    assert not any(name in advice for name in not_named), advice


def _replans(shares0: list[float]) -> list[dict]:
    return [{"step": i, "shares": [s, 1 - s], "decision": "jump"} for i, s in enumerate(shares0)]


def test_replan_oscillation_flags_reversing_shares_not_steady_convergence():
    flip = _replans([0.4, 0.6, 0.4, 0.6, 0.45, 0.6, 0.4])
    f = verdicts(RunData(make_table(), {"balance_strategy": "dynamic", "replans": flip,
                                        "config": {"balance": {"max_share_change": 1.0}}}))["replan_oscillation"]
    assert f.verdict == "problem" and f.evidence["reversal_rate"] > 0.9
    assert "--balance.max_share_change 0.15" in f.advice and "max_share_change 1.0" in f.advice
    converge = _replans([0.45, 0.42, 0.40, 0.40, 0.40, 0.39, 0.39])
    ok = verdicts(RunData(make_table(), {"balance_strategy": "dynamic", "replans": converge}))["replan_oscillation"]
    assert ok.verdict == "ok", ok.summary


def test_nonfinite_steps_checkpoint_stalls_and_padding():
    table = make_table(padded_per_real=1.8)
    table[:, 5, FIELDS.index("skipped")] = 1
    table[:, 6, FIELDS.index("loss")] = np.nan
    report = {"checkpoints": {"saves": [{"step": 10, "stall_s": 0.3}, {"step": 20, "stall_s": 0.2}]},
              "balance_strategy": "static"}
    found = verdicts(RunData(table, report))
    assert found["nonfinite_steps"].verdict == "problem"
    assert found["nonfinite_steps"].evidence == {"skipped_steps": 1, "nonfinite_loss_steps": 1, "skipped_share": 0.025}
    assert found["checkpoint_stalls"].verdict == "problem" and "--checkpoint-async" in found["checkpoint_stalls"].advice
    assert found["padding_waste"].verdict == "problem"
    assert found["padding_waste"].evidence["padding_waste"] == pytest.approx(0.8)


def test_cpu_contention_tells_every_rank_crowded_from_one_rank_starved():
    crowded = verdicts(RunData(make_table(on_cpu=(0.5, 0.52)), {"backend": "gloo"}))["cpu_contention"]
    assert crowded.verdict == "problem" and crowded.rank is None
    assert "more runnable threads than cores" in crowded.summary and "threads_per_worker" in crowded.advice
    assert crowded.evidence["on_cpu_share_per_rank"] == [0.5, 0.52]
    starved = verdicts(RunData(make_table(ranks=4, on_cpu=(0.97, 0.45, 0.95, 0.96)), {}))["cpu_contention"]
    assert starved.verdict == "problem" and starved.rank == 1 and "quota" in starved.advice
    assert verdicts(RunData(make_table(on_cpu=(0.7, 0.72)), {}))["cpu_contention"].verdict == "warn"
    # the same shares under NCCL say nothing (the thread waits for its GPU), nor does an old timeline
    assert verdicts(RunData(make_table(on_cpu=(0.5, 0.5)), {"backend": "nccl"}))["cpu_contention"].verdict == "ok"
    old = make_table(on_cpu=(0.5, 0.5))
    old[:, :, FIELDS.index("compute_cpu_s")] = old[:, :, FIELDS.index("compute_wall_s")] = np.nan
    assert "no CPU seconds" in verdicts(RunData(old, {}))["cpu_contention"].summary
    # a rank without figures (it computed nothing) is left out, not blamed
    idle = make_table(ranks=3, on_cpu=(0.97, 0.4, 0.96))
    idle[0, :, FIELDS.index("compute_wall_s")] = 0.0
    partial = verdicts(RunData(idle, {}))["cpu_contention"]
    assert partial.rank == 1 and partial.evidence["on_cpu_share_per_rank"][0] is None
    assert "rank 1's training thread was on a CPU for only 40%" in partial.summary


def test_findings_are_json_with_the_issue_keys_and_worst_first():
    findings = rules.evaluate(RunData(make_table(speeds=(1.0, 0.5)), {}))
    data = json.loads(json.dumps([f.to_dict() for f in findings]))
    assert {"rule", "verdict", "evidence", "advice", "rank"} <= set(data[0])
    assert data[0]["verdict"] == "problem"
    with pytest.raises(ValueError, match="unknown rules nope: allowed are straggler"):
        rules.evaluate(RunData(make_table(), {}), ["nope"])


def test_timeline_file_round_trip_and_field_order(tmp_path):
    table = make_table()
    save_table(table, tmp_path / "timeline.npz")
    assert np.array_equal(load_table(tmp_path / "timeline.npz"), table)
    # fields matched by name: a file with them in another order and an extra one still loads
    order = [*reversed(FIELDS), "future_field"]
    shuffled = np.concatenate([table[:, :, [FIELDS.index(f) for f in reversed(FIELDS)]], table[:, :, :1]], axis=2)
    np.savez(tmp_path / "other.npz", table=shuffled, fields=np.array(order), format=np.array("poise-timeline-1"))
    assert np.array_equal(load_table(tmp_path / "other.npz"), table)


def test_a_timeline_written_before_the_cpu_fields_loads_them_as_not_measured(tmp_path):
    table = make_table()
    old = [f for f in FIELDS if f not in OPTIONAL_FIELDS]
    np.savez(tmp_path / "old.npz", table=table[:, :, [FIELDS.index(f) for f in old]], fields=np.array(old),
             format=np.array("poise-timeline-1"))
    loaded = load_table(tmp_path / "old.npz")
    assert loaded.shape == table.shape
    assert all(np.isnan(column(loaded, f)).all() for f in OPTIONAL_FIELDS)
    assert np.array_equal(column(loaded, "step_s"), column(table, "step_s"))


@pytest.mark.parametrize("damage, message", [
    ("truncate", "not a readable poise timeline"),
    ("missing-field", "fields loss are missing"),
    ("shape", "does not match its"),
    ("nan", "durations are not finite"),
    ("absent", "no such file"),
])
def test_a_bad_timeline_file_is_one_clear_line(tmp_path, damage, message):
    path = tmp_path / "timeline.npz"
    table = make_table()
    if damage == "truncate":
        save_table(table, path)
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "missing-field":
        keep = [f for f in FIELDS if f != "loss"]
        np.savez(path, table=table[:, :, [FIELDS.index(f) for f in keep]], fields=np.array(keep),
                 format=np.array("poise-timeline-1"))
    elif damage == "shape":
        np.savez(path, table=table[:, :, :3], fields=np.array(FIELDS), format=np.array("poise-timeline-1"))
    elif damage == "nan":
        table[0, 3, FIELDS.index("step_s")] = np.nan
        save_table(table, path)
    with pytest.raises(TimelineFileError, match=message) as info:
        load_table(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_load_run_refuses_a_report_of_another_run(tmp_path):
    save_table(make_table(steps=40), tmp_path / "timeline.npz")
    (tmp_path / "report.json").write_text(json.dumps({"world_size": 2, "steps": 39}))
    with pytest.raises(ValueError, match="files of different runs"):
        load_run(tmp_path)
    (tmp_path / "report.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_run(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"world_size": 2, "steps": 40,
                                                      "config": {"cluster": {"nodes": 2, "link": "20mbit"}}}))
    assert load_run(tmp_path).link_bit_per_s == 20e6
    assert load_run(tmp_path, link="1gbit").link_bit_per_s == 1e9
    assert zipfile.is_zipfile(tmp_path / "timeline.npz")
