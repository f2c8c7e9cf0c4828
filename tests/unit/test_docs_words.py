"""The README and docs/ are for users, not a lab notebook (issues 47, 59).

They say what a setting does, how to use a capability and what it achieves today; history lives
in git. This test fails, listing the lines, on the words of the process that made them: session
and stop numbers, dated entries, names of past run directories, "re-measured" history, a
notebook's phrasing ("the runs we measured", "the target was"), a value copied from an earlier
run. And on a sentence of prose over 60 words: a reader loses its thread (code blocks, tables
and headings are not prose).
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
    ("a notebook's phrasing", r"\bin another run of the same command\b|\bthe target was\b|\bthe runs we measured\b"),
    ("a value copied from an earlier run", r"--target \d+\.\d{4,}"),
]
MAX_SENTENCE_WORDS = 60


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, line) for every line of ``text`` with a word of the process."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in PROCESS_WORDS:
            if re.search(pattern, line, re.I):
                found.append((number, what, line.strip()))
                break
    return found


def prose(text: str) -> list[str]:
    """The paragraphs and list items of a Markdown page, each joined into one line: no code
    blocks, tables, headings, comments or images."""
    units: list[str] = []
    current: list[str] = []
    fence = False

    def close() -> None:
        if current:
            units.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("```", "~~~")):
            fence = not fence
            close()
            continue
        if fence:
            continue
        if not s or s.startswith(("#", "|", "<!--", "![", "--8<--")):
            close()
            continue
        if re.match(r"([-*+]|\d+\.)\s", s):  # a list item starts a unit of its own
            close()
            s = re.sub(r"^([-*+]|\d+\.)\s+", "", s)
        current.append(s)
    close()
    return units


def sentences(unit: str) -> list[str]:
    """The sentences of one paragraph: ended by ``.``, ``!`` or ``?`` and a space (outside inline
    code); a link counts its text, not its address."""
    unit = re.sub(r"\]\([^)]*\)", "]", unit)
    unit = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "_"), unit)  # inline code: one word
    return [s for s in re.split(r"(?<=[.!?])\s+", unit) if s.strip()]


def long_sentences(text: str) -> list[tuple[int, str]]:
    """(words, sentence) for every sentence of ``text``'s prose over :data:`MAX_SENTENCE_WORDS`."""
    return [(len(s.split()), s) for unit in prose(text) for s in sentences(unit)
            if len(s.split()) > MAX_SENTENCE_WORDS]


@pytest.mark.timeout(60)
def test_no_sentence_of_the_readme_and_docs_is_over_60_words() -> None:
    found = [f"{page.relative_to(ROOT)}: {n} words: {s[:140]}"
             for page in pages() for n, s in long_sentences(page.read_text())]
    assert not found, f"sentences over {MAX_SENTENCE_WORDS} words (split them):\n" + "\n".join(found)


# The site's content column at 1280 px shows about 116 characters of a code block (measured in
# headless Chromium: a 124-character line scrolled, 114 did not); longer lines hide their ends.
MAX_CODE_COLUMNS = 110


def wide_code_lines(text: str) -> list[tuple[int, int]]:
    """(line number, characters) for every line of ``text``'s code blocks over :data:`MAX_CODE_COLUMNS`."""
    found, fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith(("```", "~~~")):
            fence = not fence
        elif fence and len(line) > MAX_CODE_COLUMNS:
            found.append((number, len(line)))
    return found


@pytest.mark.timeout(60)
def test_every_code_line_of_the_readme_and_docs_shows_whole_at_1280_px() -> None:
    found = [f"{page.relative_to(ROOT)}:{number}: {width} characters"
             for page in pages() for number, width in wide_code_lines(page.read_text())]
    assert not found, f"code lines over {MAX_CODE_COLUMNS} characters (wrap them):\n" + "\n".join(found)
    assert wide_code_lines("```\n" + "x" * (MAX_CODE_COLUMNS + 1) + "\n```") == [(2, MAX_CODE_COLUMNS + 1)]
    assert not wide_code_lines("x" * 200)


@pytest.mark.timeout(60)
def test_a_long_sentence_is_found_and_code_tables_and_short_ones_are_not() -> None:
    long = " ".join(["word"] * 61) + "."
    assert long_sentences(long)
    assert long_sentences(f"- a list item: {long}")
    assert not long_sentences(" ".join(["word"] * 30) + ". " + " ".join(["word"] * 30) + ".")
    assert not long_sentences(f"```bash\n{long}\n```")
    assert not long_sentences(f"| {long} |")
    assert not long_sentences(f"## {long}")
    assert not long_sentences("see [the page](" + "a/" * 100 + "x.md) " + " ".join(["w"] * 50) + ".")


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
    "runs' step times: 1.00x here, 1.05x in another run of the same command.",
    "loss 1.26x sooner than DDP (the target was 1.5x); int8",
    "the parameters' own updates on the runs we measured; top-k",
    "--target 3.4128707 --out runs/bench-parallel-half",
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
    "poise bench parallel --target 3.41 --out runs/p",
])
def test_what_users_read_is_not_a_process_word(line: str) -> None:
    assert not process_words(line)
