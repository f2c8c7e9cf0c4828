"""The summary ``poise train`` prints at the end, from a report: what was on, and bytes that mean something
when outer steps (local SGD, DiLoCo) leave most steps silent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from poise.diagnostics.report import summarize, summary_rows
from poise.diagnostics.timeline import FIELDS

STEPS = 20
H = 5
OUTER_BYTES = 4_000_000  # what a rank sends in one outer step


def _report(sync: dict, wire_at: list[int], wire_bytes: float, codec: str = "none") -> dict:
    """A report.json dict as Session.finish writes it: summarize() of a 2-rank, 20-step timeline in which
    each rank sends ``wire_bytes`` in the steps ``wire_at`` and nothing in the others."""
    table = np.zeros((2, STEPS, len(FIELDS)))
    for name, value in (("step_s", 0.1), ("forward_s", 0.05), ("samples", 8), ("tokens", 800), ("loss", 2.0)):
        table[:, :, FIELDS.index(name)] = value
    table[:, wire_at, FIELDS.index("wire_bytes")] = wire_bytes
    table[:, wire_at, FIELDS.index("raw_bytes")] = wire_bytes
    return {**summarize(table), "task": "code-lm", "world_size": 2, "wall_s": 2.0, "balance_strategy": "auto",
            "codec": codec, "sync": sync, "loss_unit": "bits/byte", "eval_loss": 1.5, "eval_accuracy": 0.5}


def test_an_outer_run_names_its_synchronization_its_outer_steps_and_their_bytes() -> None:
    outer_at = list(range(H - 1, STEPS, H))  # steps 4, 9, 14, 19: an outer step closes every H-th
    sync = {"mode": "diloco", "inner_steps": H, "warmup_steps": 0, "fragments": 1, "outer_steps": len(outer_at),
            "final_sync_at_finish": False, "codec": "int8", "outer_lr": 0.7, "outer_momentum": 0.9}
    report = _report(sync, outer_at, OUTER_BYTES)
    assert report["steps_sending"] == 4 and report["wire_bytes_per_sending_step"] == OUTER_BYTES
    title, rows = summary_rows(report)
    assert title == "poise train: code-lm on 2 ranks; balance auto, codec none, sync diloco (H=5)"
    values = dict(rows)
    assert values["sync"] == "diloco: outer Nesterov SGD every 5 steps (H), lr 0.7, momentum 0.9"
    assert values["outer steps"] == "4"
    # the median step sends nothing: the mean over steps 1..19 (the first is left out) is what counts
    assert values["bytes communicated / step (mean)"] == f"{OUTER_BYTES * 4 / 19 / 1e6:.3f} MB"
    assert values["bytes / step that sent"] == "4.000 MB (4 of 20 steps)"
    assert values["compression (steps that sent)"] == "1.0x (outer step: int8)"
    assert "compression" not in values  # the per-step codec's row would read 1.0x (none)


def test_warm_up_and_a_final_synchronization_are_said() -> None:
    sync = {"mode": "local_sgd", "inner_steps": H, "warmup_steps": 3, "outer_steps": 3,
            "final_sync_at_finish": True, "codec": "none", "outer_lr": 1.0, "outer_momentum": 0.0}
    values = dict(summary_rows(_report(sync, [0, 1, 2, 7, 12, 17], 1e6))[1])
    assert values["sync"] == "local_sgd: parameters averaged every 5 steps (H)"
    assert values["outer steps"] == ("3, after 3 steps synchronized every step, and one more at finish() (the loop "
                                     "ended before the last step)")
    assert values["bytes / step that sent"] == "1.000 MB (6 of 20 steps)"


def test_an_every_step_run_keeps_its_codec_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from poise.cli.train import _show_summary

    report = _report({"mode": "step"}, list(range(STEPS)), 2e6, codec="powersgd")
    title, rows = summary_rows(report)
    assert title == "poise train: code-lm on 2 ranks; balance auto, codec powersgd, sync step"
    values = dict(rows)
    assert values["bytes communicated / step (mean)"] == "2.000 MB" and values["compression"] == "1.0x (powersgd)"
    assert "outer steps" not in values and "sync" not in values
    # what poise train prints: the same rows, from report.json
    (tmp_path / "report.json").write_text(json.dumps(report))
    _show_summary(tmp_path / "report.json")
    printed = " ".join(capsys.readouterr().out.split())  # (rich wraps the title to the table's width)
    assert title in printed and "bytes communicated / step (mean) │ 2.000 MB" in printed
