"""CI's slice of the fault soak (``poise bench faults``): a killed rank and a corrupt newest
checkpoint, each checked against the uninterrupted run (issue 16)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_poise

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_fault_soak_slice_loses_nothing(tmp_path):
    proc = run_poise("bench", "faults", "--runs", "2", "--seed", "1", "--kinds", "kill,bitflip", "--out",
                     str(tmp_path), timeout_s=230)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = json.loads((tmp_path / "faults.json").read_text())["runs"]
    assert len(rows) == 2
    for row in rows:
        assert {"fault", "finished", "samples_lost", "samples_duplicated", "params_match", "hung"} <= set(row)
        assert row["outcome"] == "recovered" and row["finished"] and row["params_match"] and not row["hung"], row
        assert row["samples_lost"] == row["samples_duplicated"] == 0, row


def test_unknown_fault_kind_is_one_line(tmp_path):
    proc = run_poise("bench", "faults", "--kinds", "kill,meteor", "--out", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("poise bench: error: --kinds='kill,meteor': meteor")
