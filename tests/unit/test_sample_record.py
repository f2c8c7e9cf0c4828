"""The per-rank sample record is cut back to the steps before a resume's checkpoint by reading
only its tail: the result must be what a full parse would keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poise.train.samples import keep_steps_before


def _line(step: int, width: int = 1) -> str:
    return json.dumps({"step": step, "epoch": step // 10, "indices": list(range(step, step + width))}) + "\n"


def _full_parse(text: str, step: int) -> str:
    """What the record should hold: every complete line of an earlier step, in order."""
    kept = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except ValueError:
            continue
    return "".join(kept)


@pytest.mark.parametrize("cut", [0, 1, 7, 500, 2999, 3000, 5000])
@pytest.mark.parametrize("width", [1, 60])  # short lines, and lines longer than a block's share
def test_cutting_back_keeps_exactly_the_earlier_steps(tmp_path: Path, cut: int, width: int) -> None:
    text = "".join(_line(s, width) for s in range(3000))
    path = tmp_path / "rank-00000.jsonl"
    path.write_text(text)
    keep_steps_before(path, cut)
    assert path.read_text() == _full_parse(text, cut)


def test_a_last_line_cut_short_by_a_kill_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "rank-00001.jsonl"
    path.write_text(_line(0) + _line(1) + _line(2)[:9])
    keep_steps_before(path, 3)
    assert path.read_text() == _line(0) + _line(1)
    keep_steps_before(path, 3)  # a second resume at the same step changes nothing
    assert path.read_text() == _line(0) + _line(1)


def test_one_huge_line_and_an_empty_record(tmp_path: Path) -> None:
    path = tmp_path / "rank-00000.jsonl"
    path.write_text(_line(0, 100_000) + _line(1))  # a line longer than the first block read
    keep_steps_before(path, 1)
    assert path.read_text() == _line(0, 100_000)
    path.write_text("")
    keep_steps_before(path, 5)
    assert path.read_text() == ""
