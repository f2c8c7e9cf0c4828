"""Property-based fuzzing of the files poise reads other than checkpoints (issue 46's harness).

Config TOML, report.json, timeline.npz (its arrays, its bytes, and well-formed tables of any
figures through every rule of poise diagnose run), busbw.json and codecs.json (poise plan's
--busbw, --codec-speeds, --codec-results) and a pipeline report's profile (--profile): valid
files with parts replaced by random JSON, deleted or repeated thousands of times, random
arrays and bytes, directories, FIFOs, deep nesting, oversized files.
The property is the project's rule for bad input: **it works, or it is refused in one line** (a
``ValueError`` of one line, or exit code 2 with one line on stderr), never a traceback, and
always within bounded time and memory: each case runs in a forked child with 1 GiB more
address space and a time limit (tests/bounded.py), so a case that runs away fails there
instead of taking the machine. Seeded (``derandomize``) and small (``max_examples``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from poise.cli import main
from poise.diagnostics.timeline import FIELDS, load_table
from tests.bounded import refused_in_one_line, run_bounded
from tests.fuzzing import FUZZ, REPORT, SPECIAL, TIMEOUT_S, check, plan_into, run_dir

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                         max_size=4), max_leaves=12)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutated(data: st.DataObject, doc: Any, times: int = 2) -> Any:
    """``doc`` (a fresh copy) with up to ``times`` parts replaced by random JSON, deleted, or
    (a list) repeated many times."""
    doc = json.loads(json.dumps(doc))
    for _ in range(data.draw(st.integers(1, times), label="mutations")):
        path = data.draw(st.sampled_from(_paths(doc)), label="path")
        how = data.draw(st.sampled_from(["replace", "delete", "repeat"]), label="how")
        if not path:
            doc = data.draw(JSON, label="document") if how == "replace" else doc
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        if how == "replace":
            parent[key] = data.draw(JSON, label="value")
        elif how == "delete":
            del parent[key]
        elif isinstance(parent[key], list) and parent[key]:
            parent[key] = parent[key] * data.draw(st.sampled_from([2, 100, 5000]), label="repeat")
    return doc

@settings(FUZZ, max_examples=30)
@given(st.data())
def test_report_json(data):
    report = _mutated(data, REPORT, times=3)
    with tempfile.TemporaryDirectory() as tmp:
        directory = run_dir(Path(tmp), report)
        outcome = run_bounded(main, ["diagnose", "run", "--json", directory], timeout_s=TIMEOUT_S)
    check(outcome, report)


_ARRAYS = st.sampled_from(["float64", "float32", "int64", "bool", "U4", "complex128", "object"])


def _array(data: st.DataObject, name: str) -> np.ndarray:
    shape = data.draw(st.lists(st.integers(0, 5), max_size=4), label=f"{name} shape")
    kind = data.draw(_ARRAYS, label=f"{name} dtype")
    if kind == "object":
        return np.array([None, 1], dtype=object)
    return np.ones(shape, dtype=kind)


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_timeline_npz(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.npz"
        how = data.draw(st.sampled_from(["arrays", "bytes", "truncated", "flipped"]), label="how")
        if how == "arrays":
            arrays: dict[str, Any] = {}
            if data.draw(st.booleans(), label="real table"):
                ranks, steps = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 4))
                arrays["table"] = data.draw(st.sampled_from([0.0, -1.0, np.nan, np.inf, 1e308]), label="fill") \
                    * np.ones((ranks, steps, len(FIELDS)))
            else:
                arrays["table"] = _array(data, "table")
            names = data.draw(st.sampled_from(["all", "some", "random"]), label="fields")
            arrays["fields"] = (np.array(FIELDS) if names == "all" else np.array(FIELDS[:5]) if names == "some"
                                else _array(data, "fields"))
            if data.draw(st.booleans(), label="format"):
                arrays["format"] = np.array(data.draw(st.sampled_from(["poise-timeline-1", "x", ""])))
            buf = io.BytesIO()
            np.savez(buf, allow_pickle=True, **arrays)  # an object array goes in pickled: load_table must refuse
            path.write_bytes(buf.getvalue())
        else:
            run_dir(Path(tmp))
            raw = bytearray(path.read_bytes())
            if how == "bytes":
                raw = bytearray(data.draw(st.binary(max_size=200), label="bytes"))
            elif how == "truncated":
                raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
            else:
                for _ in range(data.draw(st.integers(1, 8), label="flips")):
                    raw[data.draw(st.integers(0, len(raw) - 1), label="at")] ^= 1 << data.draw(st.integers(0, 7))
            path.write_bytes(bytes(raw))
        outcome = run_bounded(load_table, path, timeout_s=TIMEOUT_S)
    assert outcome.kind == "ok" or refused_in_one_line(outcome), outcome.describe()


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_timeline_values_through_the_rules(data):
    # a well-formed timeline whose figures are anything a column can hold: every rule must read it
    ranks, steps = data.draw(st.integers(1, 3), label="ranks"), data.draw(st.integers(1, 12), label="steps")
    durations = {"data_s", "forward_s", "backward_s", "comm_wait_s", "optim_s", "step_s"}  # load_table's checks
    table = np.empty((ranks, steps, len(FIELDS)))
    for i, name in enumerate(FIELDS):
        figures = [0.0, 1e-12, 0.01, 1.0, 1e300] + ([] if name in durations else [-1.0, float("nan"), float("inf")])
        table[:, :, i] = np.array(data.draw(st.lists(st.sampled_from(figures), min_size=ranks * steps,
                                                     max_size=ranks * steps), label=name)).reshape(ranks, steps)
    report = {**REPORT, "world_size": ranks, "steps": steps}
    report["replans"] = [{"step": 1, "shares": [1.0 / ranks] * ranks}]
    with tempfile.TemporaryDirectory() as tmp:
        directory = run_dir(Path(tmp), report, table)
        outcome = run_bounded(main, ["diagnose", "run", "--json", directory], timeout_s=TIMEOUT_S)
    check(outcome, table.tolist())


def _config_keys() -> dict[str, list[str]]:
    from poise import config as cfg

    return {name: [f.name for f in dataclasses.fields(section)] for name, section in cfg.SECTIONS.items()}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def _load_config(path: str) -> str:
    from poise import config as cfg

    cfg.from_dict(cfg.current_layout(cfg.load_toml(path)))
    return "loaded"


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_config_toml(data):
    keys = _config_keys()
    toml_scalars = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True),
                             st.sampled_from(SPECIAL), st.text(max_size=10))
    how = data.draw(st.sampled_from(["settings", "text"]), label="how")
    if how == "settings":
        lines = []
        for section in data.draw(st.lists(st.sampled_from([*keys, "faults", "nope"]), max_size=3, unique=True)):
            lines.append(f"[{section}]")
            names = keys.get(section, ["x", "fail_at"])
            for name in data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True), label=section):
                value = data.draw(st.one_of(toml_scalars, st.lists(toml_scalars, max_size=2)), label=name)
                lines.append(f"{name} = {_toml_value(value)}")
        text = "\n".join(lines) + "\n"
    else:
        text = data.draw(st.text(max_size=80), label="text")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text)
        outcome = run_bounded(_load_config, str(path), timeout_s=TIMEOUT_S)
    assert outcome.kind == "ok" or refused_in_one_line(outcome), f"{text!r}:\n{outcome.describe()}"


_BUSBW = {"world_size": 2, "backend": "gloo", "results": [
    {"op": "all_reduce", "requested_bytes": 4096, "size_bytes": 4096, "time_s": 1e-4},
    {"op": "all_reduce", "requested_bytes": 65536, "size_bytes": 65536, "time_s": 3e-4},
    {"op": "all_reduce", "requested_bytes": 1048576, "size_bytes": 1048576, "time_s": 4e-3}]}
_CODECS = {"mbytes": 100.0, "repeats": 5, "kernels": [
    {"codec": "fp16", "encode_ms": 10.0, "decode_ms": 8.0},
    {"codec": "powersgd", "options": {"rank": 4}, "encode_ms": 40.0, "decode_ms": 20.0}],
    "runs": [{"codec": "none", "loss_delta_pct": 0.0}, {"codec": "topk:ratio=0.01", "loss_delta_pct": 1.5},
             {"codec": "fp16", "loss_delta_pct": 0.1}]}
_PROFILE = {"profile": {"names": ["embedding", "block0", "head"], "param_bytes": [4096, 8192, 4096],
                        "time_s": [0.01, 0.02, 0.01], "forward_s": [0.003, 0.007, 0.003]}}
_PLAN_FILES = {"--busbw": _BUSBW, "--codec-speeds": _CODECS, "--codec-results": _CODECS, "--profile": _PROFILE}


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_plan_input_files(data):
    flag = data.draw(st.sampled_from(sorted(_PLAN_FILES)), label="flag")
    doc = _mutated(data, _PLAN_FILES[flag], times=2)
    with tempfile.TemporaryDirectory() as tmp:
        if flag == "--profile":
            (Path(tmp) / "report.json").write_text(json.dumps(doc))
            argv = [flag, tmp]
        else:
            (Path(tmp) / "in.json").write_text(json.dumps(doc))
            argv = ["--params", "1e8", flag, str(Path(tmp) / "in.json")]
        if flag == "--busbw":
            argv += ["--nodes", "2"]
        outcome = run_bounded(plan_into, [*argv, "--codecs", "none,fp16,powersgd,topk", "--bucket-mb", "25"], tmp,
                              timeout_s=TIMEOUT_S)
    check(outcome, doc)


@settings(FUZZ, max_examples=20)
@given(st.sampled_from(["report.json", "busbw.json"]), st.sampled_from(["directory", "fifo", "deep", "large",
                                                                          "binary", "empty"]))
def test_json_files_that_are_not_json(name, make):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        if name == "report.json":
            run_dir(Path(tmp))
            path.unlink()
        if make == "directory":
            path.mkdir()
        elif make == "fifo":
            os.mkfifo(path)
        elif make == "deep":
            path.write_text("[" * 100000 + "]" * 100000)
        elif make == "large":
            with open(path, "wb") as handle:
                handle.truncate(65 << 20)  # sparse: 65 MiB of zero bytes, no disk used
        elif make == "binary":
            path.write_bytes(b"\xff\xfe\x00{")
        else:
            path.write_text("")
        argv = (["diagnose", "run", tmp] if name == "report.json"
                else ["plan", "--params", "1e8", "--nodes", "2", "--busbw", str(path), "--out", tmp])
        outcome = run_bounded(main, argv, timeout_s=TIMEOUT_S)
    assert refused_in_one_line(outcome, f"poise {argv[0]}"), f"{name} {make}:\n{outcome.describe()}"
