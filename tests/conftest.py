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
    """Run the ``poise`` CLI in a subprocess (bounded), capturing its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "poise", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=cwd or ROOT, env=env)
