"""Property-based fuzzing of what users type and what poise reads back (issue 46's harness).

Every command's arguments (``poise train``, ``pipeline``, ``plan``, ``diagnose``, ``bench``,
``checkpoint``, ``cluster``) and every file poise reads other than checkpoints (config TOML,
report.json, timeline.npz, busbw.json, codecs.json) get inputs drawn by Hypothesis: special
values (nan, inf, -1, 10^23, empty, paths that are directories or FIFOs), random text and
numbers, and valid files with one part replaced by random JSON. The property is the project's
rule for bad input: **it works, or it is refused in one line** (a ``ValueError`` of one line,
or exit code 2 with one line on stderr), never a traceback, and always within bounded time
and memory: each case runs in a forked child with 1 GiB more address space and a time limit
(tests/bounded.py), so a case that runs away fails here instead of taking the machine.

Nothing is launched: train and pipeline arguments go through the config's resolve and the
checks made before launch; ``diagnose busbw`` through its :func:`prepare`; ``bench`` and
``cluster`` (which need root and change the network) through their parsers only; ``plan`` and
``diagnose run`` run whole, being pure computations over files. Seeded (``derandomize``) and
small (``max_examples``), so the file runs in about a minute on two cores.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.cli import build_parser, main
from poise.diagnostics.timeline import FIELDS, load_table, save_table
from tests.bounded import Outcome, one_line, refused_in_one_line, run_bounded

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TIMEOUT_S = 20.0

SPECIAL = ["nan", "inf", "-inf", "-1", "0", "1", "2", "0.5", "1e300", "-1e300", "1e-300", "99999999999999999999999",
           "", " ", "abc", "1:2", "1:0.5@3", "%s", "%(prog)s", "20%", "{}", "[]", "true", "false", "none", "0x10",
           "1_000", "127.0.0.1", "::1", "slow:rank=1,x=0.2", "bernoulli:p=2,x=1", "1gbit", "5us", "/", "/dev/null",
           "/dev/zero", "..", "-", "--", "a,b", ",", "1,2,3", "9" * 5000, "é", "\t"]
# numbers at and beyond every edge, drawn more often than the rest: most bad input is one of them
NUMBERS = ["nan", "inf", "-inf", "-1", "0", "1e300", "1e-300", "99999999999999999999999", "1e15", "4294967296"]
VALUES = st.one_of(st.sampled_from(NUMBERS), st.sampled_from(SPECIAL), st.integers(-(2**70), 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   # no line breaks: argparse's "unrecognized arguments: <value>" prints them as they are, and
                   # poise/cli/__init__.py (OneLineParser.error) does not escape them yet
                   st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00\n\r\x0b\x0c\x1c\x1d\x1e"
                                         "\x85\u2028\u2029"), max_size=16))


def _options(parser: Any) -> list[str]:
    """Every long option of ``parser`` except --help."""
    return sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"})


def _subparser(*path: str) -> Any:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)
                      and name in a.choices)
        parser = action.choices[name]
    return parser


def _argv(data: st.DataObject, options: list[str], most: int = 4) -> list[str]:
    """1 to ``most`` options with drawn values, as ``--flag value`` or ``--flag=value``."""
    argv: list[str] = []
    pool = [*options, "--no-such-flag"]  # unknown flags too (and a command without options has one)
    for flag in data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=most), label="flags"):
        value = data.draw(VALUES, label=flag)
        argv += [f"{flag}={value}"] if data.draw(st.booleans(), label="joined") else [flag, value]
    return argv


def _acceptable(outcome: Outcome, prefix: str = "") -> bool:
    """Works (returns anything but the exit codes 1 and 2, or exits 0), or is refused in one line."""
    if outcome.kind == "ok" and outcome.value not in (1, 2):
        return True
    if outcome.kind == "exit" and outcome.value in (0, None):
        return True
    return refused_in_one_line(outcome, prefix)


def _check(outcome: Outcome, argv: Any) -> None:
    # "poise: error: unrecognized arguments" comes from the top parser, "poise train: error:" from
    # the command's: either is one line on stderr
    assert _acceptable(outcome, "poise"), f"{argv!r}:\n{outcome.describe()}"


# -- command-line arguments ----------------------------------------------------------------------


def _resolve(command: str, argv: list[str]) -> str:
    """Parse and resolve as ``poise train``/``pipeline`` does before it launches (nothing written)."""
    from poise.cli.flags import resolve

    args = build_parser().parse_args([command, *argv])
    config = resolve(args)
    if command == "pipeline":
        from poise.pipeline.worker import check_config

        check_config(config, config.train.batch_size)
    try:
        _preflight(config)
    except Exception as exc:  # a ValueError here is no refusal: the CLI accepted what a worker cannot use
        raise AssertionError(f"accepted, but every worker would fail: {type(exc).__name__}: {exc}") from None
    return "resolved"


def _preflight(config: Any) -> None:
    """What every worker does first with the values of a config the CLI accepted: they must not
    fail there (issue 46: --seed -1 passed the CLI and stopped every worker)."""
    from poise.train.recipe import seed_everything

    seed_everything(config.train.seed, rank=config.max_world_size() - 1)
    datetime.timedelta(seconds=config.dist.timeout_s)  # the process group's timeout
    config.emulate.delay_spec()
    config.emulate.rank_speeds()


@FUZZ
@given(st.data())
def test_train_arguments(data):
    argv = _argv(data, _options(_subparser("train")))
    _check(run_bounded(_resolve, "train", argv, timeout_s=TIMEOUT_S), argv)


def _edges() -> list[str]:
    """Every setting given alone each edge value: what the CLI accepts that a worker cannot use,
    or what escapes as another exception than a one-line ValueError."""
    from poise.cli.flags import _fields, resolve

    parser = build_parser()
    wrong = []
    for key in sorted(_fields()):
        for value in [*NUMBERS, "", "abc", "-99999999999999999999999"]:
            try:
                config = resolve(parser.parse_args(["train", "--task", "digits", f"--{key}={value}"]))
            except ValueError as exc:
                if not one_line(str(exc)):
                    wrong.append(f"--{key}={value}: a refusal of several lines: {exc!r}")
                continue
            except SystemExit as exc:
                if exc.code != 2:
                    wrong.append(f"--{key}={value}: exit {exc.code}")
                continue
            except Exception as exc:  # anything else that escaped
                wrong.append(f"--{key}={value}: {type(exc).__name__}: {exc}")
                continue
            try:
                _preflight(config)
            except Exception as exc:  # accepted, but a worker cannot use it
                wrong.append(f"--{key}={value}: accepted, then in every worker {type(exc).__name__}: {exc}")
    return wrong


def test_every_setting_at_its_edges():
    # every setting, not a sample: nan, inf, -1, 0, 1e300, 10^23, 2^32... each alone
    outcome = run_bounded(_edges, timeout_s=60)
    wrong = outcome.value if isinstance(outcome.value, list) else []
    assert outcome.kind == "ok" and not wrong, outcome.describe() + "\n".join(wrong)


@settings(FUZZ, max_examples=15)
@given(st.data())
def test_pipeline_arguments(data):
    argv = ["--task", "code-lm", *_argv(data, _options(_subparser("pipeline")), most=3)]
    _check(run_bounded(_resolve, "pipeline", argv, timeout_s=TIMEOUT_S), argv)


def _plan(argv: list[str], out: str) -> int:
    return main(["plan", *argv, "--out", out])


@settings(FUZZ, max_examples=40)
@given(st.data())
def test_plan_arguments(data):
    options = [o for o in _options(_subparser("plan")) if o != "--out"]
    argv = _argv(data, options, most=3)
    if not any(a.startswith(("--params", "--profile")) for a in argv):
        argv = ["--params", "1e8", *argv]
    with tempfile.TemporaryDirectory() as out:
        _check(run_bounded(_plan, argv, out, timeout_s=TIMEOUT_S), argv)


_PLAN_NUMBERS = ("--nodes", "--procs-per-node", "--nics-per-node", "--params", "--vocab-size", "--step-s",
                 "--optimizer-s", "--tokens-per-step", "--peak-flops", "--mfu", "--max-loss-increase", "--top",
                 "--bucket-mb", "--link", "--latency", "--intra", "--intra-latency", "--mem-bw")


def _plan_edges(out: str) -> list[str]:
    """Each of poise plan's number flags given each edge value: a refusal must be one line, and
    a plan it makes must predict finite, positive seconds in every row (``--step-s nan`` once
    predicted 0 s everywhere)."""
    import contextlib
    import io as io_

    wrong = []
    plan_json = Path(out) / "plan.json"
    for flag in _PLAN_NUMBERS:
        for value in [*NUMBERS, "", "abc", "1gbit", "5us"]:
            plan_json.unlink(missing_ok=True)
            err = io_.StringIO()
            argv = ["plan", "--params", "1e8", "--link", "10gbit", f"{flag}={value}", "--codecs", "none,fp16",
                    "--collectives", "flat,tree", "--bucket-mb", "25", "--json", "--out", out]
            with contextlib.redirect_stdout(io_.StringIO()), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as exc:
                    code = exc.code
            if code == 2:
                if not one_line(err.getvalue()):
                    wrong.append(f"{flag}={value}: a refusal of several lines: {err.getvalue()!r}")
            elif code != 0:
                wrong.append(f"{flag}={value}: exit {code}")
            else:
                rows = json.loads(plan_json.read_text())["rows"]
                if not rows or not all(math.isfinite(r["step_s"]) and r["step_s"] > 0 for r in rows):
                    wrong.append(f"{flag}={value}: accepted, predicts {[r['step_s'] for r in rows][:4]} s")
    return wrong


def test_every_plan_number_at_its_edges():
    with tempfile.TemporaryDirectory() as out:
        outcome = run_bounded(_plan_edges, out, timeout_s=90)
    wrong = outcome.value if isinstance(outcome.value, list) else []
    assert outcome.kind == "ok" and not wrong, outcome.describe() + "\n".join(wrong)


def _busbw_prepare(argv: list[str]) -> str:
    from poise.cli.diagnose import prepare

    prepare(build_parser().parse_args(["diagnose", "busbw", *argv]))
    return "prepared"


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_diagnose_arguments(data):
    kind = data.draw(st.sampled_from(["busbw", "run", "host"]), label="kind")
    options = _options(_subparser("diagnose", kind))
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "busbw":
            argv = [*_argv(data, [o for o in options if o != "--out"]), "--out", tmp]
            outcome = run_bounded(_busbw_prepare, argv, timeout_s=TIMEOUT_S)
        else:
            argv = _argv(data, [o for o in options if o != "--json"])
            if kind == "run":
                argv = [_run_dir(Path(tmp)), *argv]
            outcome = run_bounded(main, ["diagnose", kind, *argv], timeout_s=TIMEOUT_S)
    _check(outcome, [kind, *argv])


def _parse(argv: list[str]) -> str:
    build_parser().parse_args(argv)
    return "parsed"


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_bench_and_cluster_arguments_parse_or_are_refused(data):
    # parsed only: benchmarks launch jobs, cluster commands change the network (as root)
    path = data.draw(st.sampled_from([("bench", f) for f in _bench_families()]
                                     + [("cluster", a) for a in ("up", "down", "status", "check", "run")]))
    argv = [*path, *_argv(data, _options(_subparser(*path)))]
    outcome = run_bounded(_parse, argv, timeout_s=TIMEOUT_S)
    _check(outcome, argv)


def _bench_families() -> list[str]:
    from poise.cli.bench import FAMILIES

    return list(FAMILIES)


@settings(FUZZ, max_examples=20)
@given(st.sampled_from(["list", "verify"]), st.one_of(st.sampled_from(["empty", "file", "file/below", "missing"]),
                                                     VALUES), st.booleans())
def test_checkpoint_arguments(action, name, json_flag):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "empty").mkdir()
        (Path(tmp) / "file").write_text("")
        target = os.path.join(tmp, name.replace("..", "_").lstrip("/"))  # never outside the temporary directory
        argv = ["checkpoint", action, target, *(["--json"] if json_flag and action == "list" else [])]
        outcome = run_bounded(main, argv, timeout_s=TIMEOUT_S)
    # verify exits 1 when nothing verifies (its documented answer), with one line
    assert _acceptable(outcome, "poise checkpoint") or (outcome.value == 1 and one_line(outcome.err)), \
        f"{argv!r}:\n{outcome.describe()}"


# -- files poise reads ----------------------------------------------------------------------------

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


def _run_dir(out: Path, report: dict[str, Any] | None = None, table: np.ndarray | None = None) -> str:
    """A finished run's directory: a report.json and a timeline.npz of 2 ranks x 8 steps."""
    if table is None:
        table = np.abs(np.random.default_rng(0).normal(0.01, 0.005, (2, 8, len(FIELDS))))
        table[:, :, FIELDS.index("skipped")] = 0
    save_table(table, out / "timeline.npz")
    (out / "report.json").write_text(json.dumps(report if report is not None else _REPORT))
    return str(out)


_REPORT = {"world_size": 2, "steps": 8, "task": "digits", "codec": "none", "backend": "gloo", "balance": 0.9,
           "balance_strategy": "dynamic", "replans": [{"step": 4, "shares": [0.5, 0.5]}, {"step": 6,
                                                                                          "shares": [0.6, 0.4]}],
           "checkpoints": {"saves": [{"step": 4, "stall_s": 0.01}]},
           "config": {"cluster": {"nodes": 2, "link": "1gbit"}, "balance": {"max_share_change": 0.2}}}


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_report_json(data):
    report = _mutated(data, _REPORT, times=3)
    with tempfile.TemporaryDirectory() as tmp:
        directory = _run_dir(Path(tmp), report)
        outcome = run_bounded(main, ["diagnose", "run", "--json", directory], timeout_s=TIMEOUT_S)
    _check(outcome, report)


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
            _run_dir(Path(tmp))
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
    report = {**_REPORT, "world_size": ranks, "steps": steps}
    report["replans"] = [{"step": 1, "shares": [1.0 / ranks] * ranks}]
    with tempfile.TemporaryDirectory() as tmp:
        directory = _run_dir(Path(tmp), report, table)
        outcome = run_bounded(main, ["diagnose", "run", "--json", directory], timeout_s=TIMEOUT_S)
    _check(outcome, table.tolist())


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
        outcome = run_bounded(_plan, [*argv, "--codecs", "none,fp16,powersgd,topk", "--bucket-mb", "25"], tmp,
                              timeout_s=TIMEOUT_S)
    _check(outcome, doc)


@settings(FUZZ, max_examples=20)
@given(st.sampled_from(["report.json", "busbw.json"]), st.sampled_from(["directory", "fifo", "deep", "large",
                                                                          "binary", "empty"]))
def test_json_files_that_are_not_json(name, make):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        if name == "report.json":
            _run_dir(Path(tmp))
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
