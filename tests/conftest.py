"""Shared fixtures: one corpus cache per test session, so the stdlib is indexed once."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """One line, not a collection error per module, when this Python has no torch (pytest run
    outside the checkout's environment)."""
    if importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(f"torch is not installed for {sys.executable}: run `make test` (it makes .venv "
                                "and runs the suite there) or `.venv/bin/python -m pytest`")


@pytest.fixture(scope="session", autouse=True)
def _fork_server(request: pytest.FixtureRequest) -> None:
    """The tests' fork server (tests/harness.py), started before the first test of a session that
    runs jobs (the dist, e2e and cluster tiers): the first of them then times its own work only."""
    if any(item.nodeid.startswith(("tests/dist/", "tests/e2e/", "tests/cluster/")) for item in request.session.items):
        from tests.harness import start_server

        start_server()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus cache private to this test session."""
    return tmp_path_factory.mktemp("poise-cache")


def run_poise(*args: str, timeout_s: float = 240.0, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``poise`` CLI (bounded), capturing its output, as ``python -m poise ARGS`` would:
    in a process forked from the tests' warm server (:func:`tests.harness.run_cli`), so that a job
    does not pay the command's interpreter start and imports.

    A ``train`` job that names no ``--balance`` runs ``static``: these tests check resumes,
    checkpoints, codecs and the launcher on plain DDP's split, which does not depend on what a
    loaded machine measures. The default, ``auto`` (re-planned from measured speeds), is
    tested where it is named (``--balance auto``) and by the README's and docs' own commands."""
    if args and args[0] == "train" and "--balance" not in args:
        args = (*args, "--balance", "static")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    from tests.harness import run_cli

    return run_cli(list(args), cwd=cwd or ROOT, env=env, timeout_s=timeout_s)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A ``long`` test (see pyproject's markers) must name, as ``covered_by``, the test of
    ``make test`` that runs its code paths: ``path::name`` of a test function that exists."""
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is None:
            continue
        covered_by = mark.kwargs.get("covered_by", "")
        path, _, name = covered_by.partition("::")
        source = ROOT / path
        if not (name and source.is_file() and re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M)):
            raise pytest.UsageError(f"{item.nodeid}: long(covered_by={covered_by!r}) names no test function "
                                    "(path::name) of make test")
