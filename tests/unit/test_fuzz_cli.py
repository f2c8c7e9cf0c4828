"""Property-based fuzzing of every command's arguments (issue 46's harness, command lines).

``poise train``, ``pipeline``, ``plan``, ``diagnose``, ``bench``, ``checkpoint`` and ``cluster``
get arguments drawn by Hypothesis (edge numbers, special strings, random text, unknown flags),
and every config setting and every plan number flag is given each edge value in turn.
The property is the project's rule for bad input: **it works, or it is refused in one line** (a
``ValueError`` of one line, or exit code 2 with one line on stderr), never a traceback, and
always within bounded time and memory: each case runs in a forked child with 1 GiB more
address space and a time limit (tests/bounded.py), so a case that runs away fails there
instead of taking the machine. Seeded (``derandomize``) and small (``max_examples``).

Nothing is launched: train and pipeline arguments go through the config's resolve, the checks
made before launch, and what every worker does first with the values (:func:`_preflight`: a
value the CLI accepts must not fail there); ``diagnose busbw`` through its ``prepare``;
``bench`` and ``cluster`` (which need root and change the network) through their parsers
only; ``plan``, ``diagnose run``/``host`` and ``checkpoint`` run whole (reads only).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from poise.cli import build_parser, main
from tests.bounded import one_line, run_bounded
from tests.fuzzing import (
    FUZZ,
    NUMBERS,
    TIMEOUT_S,
    VALUES,
    acceptable,
    check,
    draw_argv,
    options_of,
    plan_into,
    run_dir,
    subparser,
)


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
    argv = draw_argv(data, options_of(subparser("train")))
    check(run_bounded(_resolve, "train", argv, timeout_s=TIMEOUT_S), argv)


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
    argv = ["--task", "code-lm", *draw_argv(data, options_of(subparser("pipeline")), most=3)]
    check(run_bounded(_resolve, "pipeline", argv, timeout_s=TIMEOUT_S), argv)

@settings(FUZZ, max_examples=40)
@given(st.data())
def test_plan_arguments(data):
    options = [o for o in options_of(subparser("plan")) if o != "--out"]
    argv = draw_argv(data, options, most=3)
    if not any(a.startswith(("--params", "--profile")) for a in argv):
        argv = ["--params", "1e8", *argv]
    with tempfile.TemporaryDirectory() as out:
        check(run_bounded(plan_into, argv, out, timeout_s=TIMEOUT_S), argv)


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
    options = options_of(subparser("diagnose", kind))
    with tempfile.TemporaryDirectory() as tmp:
        if kind == "busbw":
            argv = [*draw_argv(data, [o for o in options if o != "--out"]), "--out", tmp]
            outcome = run_bounded(_busbw_prepare, argv, timeout_s=TIMEOUT_S)
        else:
            argv = draw_argv(data, [o for o in options if o != "--json"])
            if kind == "run":
                argv = [run_dir(Path(tmp)), *argv]
            outcome = run_bounded(main, ["diagnose", kind, *argv], timeout_s=TIMEOUT_S)
    check(outcome, [kind, *argv])


def _parse(argv: list[str]) -> str:
    build_parser().parse_args(argv)
    return "parsed"


@settings(FUZZ, max_examples=30)
@given(st.data())
def test_bench_and_cluster_arguments_parse_or_are_refused(data):
    # parsed only: benchmarks launch jobs, cluster commands change the network (as root)
    path = data.draw(st.sampled_from([("bench", f) for f in _bench_families()]
                                     + [("cluster", a) for a in ("up", "down", "status", "check", "run")]))
    argv = [*path, *draw_argv(data, options_of(subparser(*path)))]
    outcome = run_bounded(_parse, argv, timeout_s=TIMEOUT_S)
    check(outcome, argv)


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
    assert acceptable(outcome, "poise checkpoint") or (outcome.value == 1 and one_line(outcome.err)), \
        f"{argv!r}:\n{outcome.describe()}"


# -- files poise reads ----------------------------------------------------------------------------
