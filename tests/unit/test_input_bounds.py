"""Inputs that used to run away or pass silently (issue 46 items 2, 3, 7, 8, 12): each is
refused in one line with exit 2, within bounded memory and time (cases that could grow or hang
before the fix run in a forked child with a memory and time limit, tests/bounded.py)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.cli import build_parser, main
from poise.diagnostics.timeline import FIELDS, TimelineFileError, load_table, save_table
from poise.plan.costs import MAX_WORLD_SIZE, Cluster, Link, tree_all_reduce_s
from poise.train.recipe import seed_everything
from tests.bounded import one_line, refused_in_one_line, run_bounded


def _plan(*flags: str) -> int:
    return main(["plan", *flags])


# -- item 2: a cluster beyond what the planner computes in bounded memory ----------------------


def test_a_billion_nodes_is_refused_in_one_line_without_growing():
    outcome = run_bounded(_plan, "--params", "7e9", "--nodes", "1000000000", "--link", "400gbit",
                          memory_bytes=1 << 30, timeout_s=20)
    assert refused_in_one_line(outcome, "poise plan: error: --nodes=1000000000 is invalid"), outcome.describe()
    outcome = run_bounded(_plan, "--params", "7e9", "--nodes", "4096", "--procs-per-node", "4096", "--link", "1gbit")
    assert refused_in_one_line(outcome, "poise plan: error: --nodes=4096 x --procs-per-node=4096"), outcome.describe()
    with pytest.raises(ValueError, match=f"at most {MAX_WORLD_SIZE} ranks"):
        Cluster(MAX_WORLD_SIZE, 2, Link(0, 1), Link(0, 1))


def test_the_largest_cluster_allowed_plans_within_bounded_memory(tmp_path):
    # 2^20 ranks with the tree collective (the one whose crossing pattern covers every rank)
    outcome = run_bounded(_plan, "--params", "1e9", "--nodes", str(MAX_WORLD_SIZE // 8), "--procs-per-node", "8",
                          "--link", "400gbit", "--collectives", "tree", "--codecs", "none,fp16", "--bucket-mb", "25",
                          memory_bytes=1 << 30, timeout_s=60)
    assert outcome.kind == "ok" and outcome.value == 0, outcome.describe()


def _tree_reference(cluster: Cluster, nbytes: float) -> float:
    """Recursive doubling rank by rank (the former implementation): the fast one must agree."""
    n = cluster.world_size
    if n == 1:
        return 0.0
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    real = [2 * v + 1 if v < extra else v + extra for v in range(p)]
    total, distance = 0.0, 1
    while distance < p:
        crossing: dict[int, int] = {}
        local = False
        for v, rank in enumerate(real):
            peer = real[v ^ distance]
            if cluster.node_of(rank) != cluster.node_of(peer):
                crossing[cluster.node_of(rank)] = crossing.get(cluster.node_of(rank), 0) + 1
            else:
                local = True
        times = [cluster.inter.time_s(c * nbytes) for c in crossing.values()]
        if local:
            times.append(cluster.intra.time_s(nbytes))
        total += max(times)
        distance <<= 1
    if extra:
        straddle = any(cluster.node_of(2 * i) != cluster.node_of(2 * i + 1) for i in range(extra))
        total += 2 * (cluster.inter if straddle else cluster.intra).time_s(nbytes)
    return total


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 40), st.integers(1, 12), st.floats(1.0, 1e9))
def test_the_tree_cost_computed_per_shape_equals_rank_by_rank(nodes, per_node, nbytes):
    cluster = Cluster(nodes, per_node, Link(1e-6, 1e10), Link(1e-5, 1e9))
    assert tree_all_reduce_s(cluster, nbytes) == pytest.approx(_tree_reference(cluster, nbytes), rel=1e-12)


# -- item 3: parameter counts the model search never finishes --------------------------------


@pytest.mark.parametrize("value", ["inf", "1e300", "nan", "-5", "1e16"])
def test_absurd_parameter_counts_are_refused_at_once(value):
    outcome = run_bounded(_plan, "--params", value, timeout_s=10)
    assert refused_in_one_line(outcome, f"poise plan: error: --params={float(value):g} is invalid"), \
        outcome.describe()


# -- item 8: nonsense the planner used to accept ---------------------------------------------


@pytest.mark.parametrize("flags,match", [
    (("--step-s", "nan"), "--step-s=nan is invalid"),
    (("--mfu", "inf"), "--mfu=inf is invalid: allowed is a number in (0, 1]"),
    (("--mfu", "2"), "--mfu=2.0 is invalid"),
    (("--vocab-size=-5",), "--vocab-size=-5 is invalid"),
    (("--max-loss-increase", "nan"), "--max-loss-increase=nan is invalid"),
    (("--top=-1",), "--top=-1 is invalid"),
    (("--bucket-mb", "inf"), "--bucket-mb='inf' is invalid"),
    (("--link", "1" * 400 + "gbit", "--nodes", "2"), "--link '111"),
    (("--latency", "99999s", "--link", "1gbit", "--nodes", "2"), "--latency '99999s' is invalid"),
])
def test_plan_flags_out_of_range_are_refused(flags, match, capsys):
    assert _plan("--params", "1e9", *flags) == 2
    err = capsys.readouterr().err
    assert one_line(err) and match in err, err


def test_codec_results_that_are_not_codec_results_are_refused(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"world_size": 2, "steps": 10, "config": {}}))
    assert _plan("--params", "1e9", "--codec-results", str(report)) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "is not a codecs.json of poise bench codecs" in err, err


@pytest.mark.parametrize("content", [
    '{"world_size": 2}', '{"world_size": "x", "results": []}', '{"world_size": 2, "results": [5]}',
    '{"world_size": 2, "results": [{"op": "all_reduce", "size_bytes": 1e308, "time_s": 1e-300}, '
    '{"op": "all_reduce", "size_bytes": 1, "time_s": 1}]}',
    '[' * 100000 + ']' * 100000, '{"world_size": NaN}',
])
def test_busbw_files_of_the_wrong_shape_are_refused(tmp_path, content, capsys):
    path = tmp_path / "busbw.json"
    path.write_text(content)
    assert _plan("--params", "1e9", "--nodes", "2", "--busbw", str(path)) == 2
    err = capsys.readouterr().err
    assert one_line(err) and err.startswith("poise plan: error: --busbw"), err


# -- item 7: a file where plan.json's directory should be ----------------------------------


def test_plan_json_into_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("")
    assert _plan("--params", "1e9", "--json", "--out", str(target)) == 2
    assert _plan("--params", "1e9", "--json", "--out", str(target / "below")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("poise plan: error: --out") for line in err), err


# -- item 7: diagnose run on a report whose figures have the wrong type -----------------------


def _run_dir(tmp_path: Path, report: dict) -> Path:
    table = np.zeros((2, 6, len(FIELDS)))
    table[:, :, FIELDS.index("step_s")] = 0.1
    save_table(table, tmp_path / "timeline.npz")
    (tmp_path / "report.json").write_text(json.dumps({"world_size": 2, "steps": 6, **report}))
    return tmp_path


@pytest.mark.parametrize("report", [
    {"config": 5}, {"config": {"cluster": 5}}, {"config": {"cluster": {"nodes": 2, "link": 7}}},
    {"balance": None}, {"balance": "x"}, {"replans": [{"shares": [0.5, 0.5]}, {"shares": [1.0]}]},
    {"replans": 3}, {"checkpoints": {"saves": [{"stall_s": "x"}]}}, {"world_size": 2.5}, {"codec": 3},
])
def test_diagnose_run_refuses_reports_of_the_wrong_shape(tmp_path, report, capsys):
    assert main(["diagnose", "run", str(_run_dir(tmp_path, report))]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and err.startswith("poise diagnose: error: "), err


def test_diagnose_run_still_reads_a_plain_run(tmp_path, capsys):
    assert main(["diagnose", "run", "--json", str(_run_dir(tmp_path, {"config": {"cluster": {}}}))]) == 0


def _npy(array: np.ndarray | None = None, header: dict | None = None) -> bytes:
    buf = io.BytesIO()
    if header is not None:
        np.lib.format.write_array_header_1_0(buf, header)  # a header alone: what it promises is never written
    else:
        np.save(buf, array)
    return buf.getvalue()


def test_a_timeline_whose_header_promises_a_huge_table_is_refused_unread(tmp_path):
    path = tmp_path / "timeline.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("table.npy", _npy(header={"descr": "<f8", "fortran_order": False,
                                                   "shape": (1 << 20, 1 << 20, len(FIELDS))}))
        archive.writestr("fields.npy", _npy(np.array(FIELDS)))
        archive.writestr("format.npy", _npy(np.array("poise-timeline-1")))
    outcome = run_bounded(load_table, path, memory_bytes=1 << 30, timeout_s=20)
    assert outcome.kind == "refused" and "more than" in outcome.message and one_line(outcome.message), \
        outcome.describe()
    with pytest.raises(TimelineFileError, match="no such file"):
        load_table(tmp_path / "missing.npz")


# -- item 12: help text with a percent sign -----------------------------------------------------


def _parsers(parser):
    yield parser
    for action in parser._actions:
        if hasattr(action, "choices") and isinstance(action.choices, dict):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_help_prints_its_text_not_argparse_internals(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps the help
    assert "under 20% random worker delays" in out and "{'" not in out, out
    for parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "{'option_strings'" not in text and "'prog':" not in text, parser.prog


# -- items 6 and 8: train settings that failed only inside the workers, or never ------------


def _resolve(*flags: str):
    from poise.cli.flags import resolve

    return resolve(build_parser().parse_args(["train", "--task", "digits", *flags]))


@pytest.mark.parametrize("flags,match", [
    (("--seed", "-1"), r"^train.seed=-1 is invalid: allowed is 0..4194303$"),
    (("--seed", "4294967"), r"^train.seed=4294967 is invalid"),  # seed x 1000 + rank is past numpy's 2^32 - 1
    (("--seed", "99999999999999999999999"), r"^train.seed=99999999999999999999999 is invalid"),
    (("--metrics.host", "not.a.host"), r"^metrics.host='not.a.host' is invalid: give an IP address"),
    (("--metrics.port", "0", "--metrics.host", "example.org"), r"^metrics.host='example.org' is invalid"),
    (("--nproc", "2", "--delay", "slow:rank=9,x=0.2"), r"^straggler.delay='slow:rank=9,x=0.2' names rank 9, .* 0..1$"),
    (("--rank-speed", "1:1e-300"), r"^balance.rank_speed: speed '1e-300' of rank 1 is outside \[0.01, 1\]"),
    (("--steps", "99999999999999999999999"), r"^train.steps=99999999999999999999999 is invalid: allowed is at most"),
    (("--train.eval_every", "99999999999999999999999"), r"^train.eval_every=\d+ is invalid"),
])
def test_train_settings_out_of_range_are_refused_before_launch(flags, match):
    with pytest.raises(ValueError, match=match):
        _resolve(*flags)


def test_addresses_and_the_edges_of_the_ranges_are_accepted():
    for host in ("127.0.0.1", "0.0.0.0", "::1", "localhost"):
        assert _resolve("--metrics.host", host).metrics.host == host
    config = _resolve("--seed", str(2**22 - 1), "--rank-speed", "1:0.01", "--nproc", "2",
                      "--delay", "slow:rank=1,x=0.2")
    assert config.train.seed == 2**22 - 1
    seed_everything(config.train.seed, rank=10**8 - 1)  # what every worker does with it first


def test_the_cli_refuses_them_with_exit_2(capsys):
    assert main(["train", "--task", "digits", "--seed", "-1"]) == 2
    assert main(["train", "--task", "digits", "--metrics.port", "0", "--metrics.host", "not.a.host"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("poise train: error: ") for line in lines), lines


# -- item 7: a config path that is no file -----------------------------------------------------


@pytest.mark.parametrize("make", ["directory", "fifo", "deep", "large", "binary"])
def test_config_paths_that_are_no_config_file_are_refused(tmp_path, make):
    import os

    path = tmp_path / "c.toml"
    if make == "directory":
        path.mkdir()
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "deep":
        path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    elif make == "large":
        path.write_text("# " + "x" * (2 << 20) + "\n")
    else:
        path.write_bytes(b"\xff\xfe\x00bad")
    outcome = run_bounded(_resolve, "--config", str(path), timeout_s=20)  # resolves, never launches
    assert refused_in_one_line(outcome) and outcome.message.startswith("config file"), outcome.describe()


def test_a_timeline_with_a_non_finite_count_is_refused(tmp_path, capsys):
    # found by test_fuzz_files: an inf in 'skipped' ended nonfinite_steps in OverflowError
    table = np.zeros((2, 3, len(FIELDS)))
    table[1, 2, FIELDS.index("skipped")] = np.inf
    _run_dir(tmp_path, {"steps": 3})
    save_table(table, tmp_path / "timeline.npz")
    assert main(["diagnose", "run", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "counts (steps, samples, tokens, bytes, skipped) are not finite" in err, err


def test_benchmark_counts_and_timeouts_must_be_finite():
    from argparse import Namespace

    from poise.bench.harness import require_positive

    require_positive(Namespace(steps=3, timeout_s=60.0), "steps", "timeout_s")
    for value in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^--timeout-s=.* must be positive and finite$"):
            require_positive(Namespace(timeout_s=value), "timeout_s")
