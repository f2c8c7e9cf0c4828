"""Property-based fuzzing of what a checkpoint directory holds (issue 46's harness, checkpoint half).

Hypothesis draws a manifest.json (any JSON, deep nesting, random bytes, a valid manifest with
one part replaced), a state.pt or rank file (any nest of plain values and small tensors, saved
and rehashed as an attacker would), symbolic links in place of files or folders, and unfinished
``.partial`` folders beside the checkpoints. The properties, for the newest checkpoint of two:

- ``poise checkpoint verify`` exits 0 or 1, and 1 with one line on stderr; ``list --json``
  exits 0; neither raises;
- the resume's choice (:func:`find_resume_point`) is a checkpoint that verifies: the newest
  when ``verify`` said 0, else the previous good one; never a traceback;
- all of it within bounded time and memory: every case runs in a forked child with 1 GiB more
  address space and a time limit (tests/bounded.py).

Seeded (``derandomize``) and small (``max_examples``): the file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poise.checkpoint import directory, layout
from poise.checkpoint.saver import find_resume_point
from poise.cli import main
from tests.bounded import run_bounded
from tests.unit.test_checkpoint import _config
from tests.unit.test_checkpoint_safety import _save

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=25,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
NEWEST, PREVIOUS = "step-00000002", "step-00000001"

JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
PLAIN = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8)
                     | st.builds(lambda n: torch.arange(n, dtype=torch.float32), st.integers(0, 4)),
                     lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=15)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A checkpoint directory with two good checkpoints, copied for every case."""
    root = tmp_path_factory.mktemp("template") / "checkpoints"
    _save(root, [1, 2])
    directory.unlock(root)
    (root / layout.LOCK).unlink()
    return root


def _copy(template: Path, tmp_path: Path) -> Path:
    case = tmp_path / f"case-{os.urandom(4).hex()}" / "checkpoints"
    shutil.copytree(template, case, symlinks=True)
    return case


def _rehash(path: Path, name: str) -> None:
    manifest = json.loads((path / layout.MANIFEST).read_text())
    data = (path / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))


def _commands(root: str) -> dict[str, Any]:
    """In the bounded child: verify, list and the resume's choice; what each did."""
    out: dict[str, Any] = {}
    for name, argv in (("verify", ["checkpoint", "verify", root]), ("list", ["checkpoint", "list", root, "--json"])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            out[name] = (main(argv), err.getvalue())
    try:
        found = find_resume_point(_config(Path(root).parent, resume=True), required=True)
        out["resume"] = found[0]
    except ValueError as exc:
        out["resume"] = f"refused: {exc}"
    return out


def _check(root: Path) -> dict[str, Any]:
    outcome = run_bounded(_commands, str(root), timeout_s=30.0)
    assert outcome.kind == "ok", outcome.describe()
    got = outcome.value
    code, err = got["verify"]
    assert code in (0, 1), got
    assert code == 0 or (err.count("\n") == 1 and "Traceback" not in err), got
    assert got["list"][0] == 0, got
    assert got["resume"] == (NEWEST if code == 0 else PREVIOUS), got
    return got


@FUZZ
@given(text=st.one_of(JSON.map(json.dumps),
                      st.integers(1, 200_000).map(lambda n: "[" * n + "]" * n),
                      st.integers(1, 100_000).map(lambda n: '{"a":' * n + "0" + "}" * n),
                      st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_any_manifest_is_refused_in_one_line_or_works(template, tmp_path, text):
    root = _copy(template, tmp_path)
    (root / NEWEST / layout.MANIFEST).write_text(text)
    assert _check(root)["verify"][0] == 1


@FUZZ
@given(where=st.lists(st.text(min_size=1, max_size=3), min_size=0, max_size=4), value=JSON)
def test_a_manifest_with_one_part_replaced_is_refused_in_one_line_or_works(template, tmp_path, where, value):
    root = _copy(template, tmp_path)
    manifest = json.loads((root / NEWEST / layout.MANIFEST).read_text())
    node: Any = manifest
    keys = ["files", "tensors", "bases", "params", "dtypes", "step", "world_size", "kind", "config"]
    path = [keys[len(where) % len(keys)], *where]
    for key in path[:-1]:  # walk as far as the drawn path goes, then replace what is there
        if isinstance(node, dict) and node:
            key = sorted(node)[sum(map(ord, key)) % len(node)] if key not in node else key
            if isinstance(node[key], (dict, list)):
                node = node[key]
                continue
        break
    if isinstance(node, dict) and node:
        node[sorted(node)[len(path) % len(node)]] = value
    elif isinstance(node, list) and node:
        node[0] = value
    (root / NEWEST / layout.MANIFEST).write_text(json.dumps(layout.sealed(manifest)))
    _check(root)


@FUZZ
@given(file=st.sampled_from(["state.pt", layout.rank_file(0), "model.pt", "optim.pt"]), payload=PLAIN)
def test_any_rehashed_file_content_is_refused_in_one_line_or_works(template, tmp_path, file, payload):
    root = _copy(template, tmp_path)
    directory.write_payload(root / NEWEST, file, payload)
    _rehash(root / NEWEST, file)  # an attacker fixes the checksum up
    _check(root)


@FUZZ
@given(target=st.sampled_from(["model.pt", "optim.pt", "state.pt", layout.rank_file(0), layout.MANIFEST, "folder"]),
       partials=st.integers(0, 3))
def test_symlinks_are_refused_and_unfinished_saves_are_removed(template, tmp_path, target, partials):
    root = _copy(template, tmp_path)
    outside = tmp_path / f"outside-{os.urandom(4).hex()}"
    if target == "folder":
        os.rename(root / NEWEST, outside)
        os.symlink(outside, root / NEWEST, target_is_directory=True)
    else:
        os.rename(root / NEWEST / target, outside)  # the same bytes: every checksum matches
        os.symlink(outside, root / NEWEST / target)
    for index in range(partials):
        stale = root / layout.partial_name(3 + index, layout.new_token())
        stale.mkdir()
        (stale / "model.pt").write_bytes(b"x" * 100)
    got = _check(root)
    assert got["verify"][0] == 1 and "symbolic link" in got["verify"][1], got
    assert not [p for p in root.iterdir() if p.name.startswith(layout.PARTIAL_PREFIX)]
    assert outside.exists()  # the link was never followed into a deletion
