"""The README and docs/ are for users, not a lab notebook (issue 47).

They say what a setting does, how to use a capability and what it achieves today; history lives
in git. This test fails, listing the lines, on the words of the process that made them: session
and stop numbers, dated entries, names of past run directories, "re-measured" history.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

# (what it is, pattern): searched case-insensitively in every line
PROCESS_WORDS: list[tuple[str, str]] = [
    ("a session or stop number", r"\b(sessions?|stops?)\s+\d+"),
    ("a dated heading", r"^#+\s.*\b20\d\d-\d\d(-\d\d)?\b"),
    ("a date", r"\b20\d\d-\d\d-\d\d\b"),
    ("a past run's directory", r"\bruns/s\d+[-_{]"),
    ("re-measured history", r"\bre-?measured\b"),
]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, line) for every line of ``text`` with a word of the process."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in PROCESS_WORDS:
            if re.search(pattern, line, re.I):
                found.append((number, what, line.strip()))
                break
    return found


@pytest.mark.timeout(60)
def test_the_readme_and_docs_hold_no_words_of_the_process() -> None:
    found = [f"{page.relative_to(ROOT)}:{n}: {what}: {line[:160]}"
             for page in pages() for n, what, line in process_words(page.read_text())]
    assert not found, "words of the process in the docs (history lives in git):\n" + "\n".join(found)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", [
    "Again in session 41, with freed memory kept",
    "measured the old way (stops 32–36)",
    "### 2026-12-05 (later): errors relative to the other ranks",
    "Again on 2026-12-04, same code for balancing",
    "(`poise bench balance --runs c,e`, `runs/s40-new-ef3`)",
    "--out runs/s41-{plain,nommap}-c-{1..6}",
    "Re-measured on a fresh machine of the same kind",
])
def test_each_kind_of_process_word_is_found(line: str) -> None:
    assert process_words(line)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", [
    "session = poise.Session(model, data, balance=\"dynamic\")",
    "`--train.stop_at_eval_loss X` stops at the first evaluation that reaches X",
    "poise train --steps 200 --out runs/a",
    "rank 1's share 0.332, measured over the last 20 steps",
    "with a session of 12 ranks",
])
def test_what_users_read_is_not_a_process_word(line: str) -> None:
    assert not process_words(line)
