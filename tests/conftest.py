"""Shared fixtures: one corpus cache per test session, so the stdlib is indexed once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A corpus cache private to this test session."""
    return tmp_path_factory.mktemp("poise-cache")


def run_poise(*args: str, timeout_s: float = 240.0, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``poise`` CLI in a subprocess (bounded), capturing its output.

    A ``train`` job that names no ``--balance`` runs ``static``: these tests check resumes,
    checkpoints, codecs and the launcher on plain DDP's split, which does not depend on what a
    loaded machine measures. The default, ``auto`` (re-planned from measured speeds), is
    tested where it is named (``--balance auto``) and by the README's and docs' own commands."""
    if args and args[0] == "train" and "--balance" not in args:
        args = (*args, "--balance", "static")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "poise", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd or ROOT, env=env)
