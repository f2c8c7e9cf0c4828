"""A failure after the run's final checkpoint (in evaluation or the report: found by
``poise bench faults``) restarts into a run with nothing left to train: it ends cleanly."""

from __future__ import annotations

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e

JOB = ("train", "--task", "digits", "--nproc", "2", "--steps", "6", "--checkpoint-every", "3",
       "--diagnostics.progress", "false", "--diagnostics.plot", "false")


def test_resuming_from_the_final_checkpoint_ends_cleanly(tmp_path):
    first = run_poise(*JOB, "--out", str(tmp_path), timeout_s=120)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_poise(*JOB, "--resume", "--out", str(tmp_path), timeout_s=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing left to train" in again.stderr
