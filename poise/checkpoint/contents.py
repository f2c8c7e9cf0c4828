"""Whether a checkpoint can be loaded, checked by loading it as a resume does.

:func:`poise.checkpoint.layout.verify` proves that the files are the ones the manifest names
(sizes and sha256); it cannot tell that what they hold is a training state: a tensor changed
and the manifest rehashed, a pickle payload, a ``state.pt`` that is a list all match their
checksums. :func:`check_contents` therefore reads every file of the checkpoint the way
:func:`poise.checkpoint.saver.load` does (``torch.load(weights_only=True)``, never through a
symbolic link) and checks the structure :func:`poise.checkpoint.state.restore` relies on: the
tables and their keys, every tensor a tensor, the model's tensors of the names, shapes and
dtypes the manifest records, the step of every file the manifest's. ``poise checkpoint
verify`` and the choice of the checkpoint to resume from (:func:`newest_loadable`) both use
it, so that a checkpoint that verifies is one a resume can load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from poise.checkpoint import layout
from poise.checkpoint.layout import CorruptCheckpoint
from poise.checkpoint.state import rank_problem, shared_problem, sync_disagreement, tensor_problems

log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _table_problem(table: Any) -> str:
    """What keeps a ``model.pt``/``optim.pt`` from being a table of tensors (or of a delta's
    tensors, a list of them) ('' when nothing)."""
    if not isinstance(table, dict):
        return f"it holds a {type(table).__name__}"
    for key, value in table.items():
        parts = value if isinstance(value, list) else [value]
        if not isinstance(key, str) or not all(isinstance(t, torch.Tensor) for t in parts):
            return f"entry {str(key)[:40]!r} is not a tensor"
    return ""


def check_contents(root: Path, name: str, manifest: dict[str, Any]) -> None:
    """Load every file of checkpoint ``name`` (whose manifest is ``manifest``) and check its structure.

    Raises:
        CorruptCheckpoint: naming the file and what it holds instead of a training state.
    """
    step, world = manifest["step"], manifest["world_size"]
    needed = ["model.pt", "optim.pt", "state.pt", *(layout.rank_file(r) for r in range(world))]
    missing = [f for f in needed if f not in manifest["files"]]
    if missing:
        raise CorruptCheckpoint(f"{name}: the manifest lists no {missing[0]}")
    params, dtypes = manifest["params"], manifest.get("dtypes")
    if not all(isinstance(k, str) and isinstance(v, list) and all(isinstance(d, int) for d in v)
               for k, v in params.items()) or (dtypes is not None and not isinstance(dtypes, dict)):
        raise CorruptCheckpoint(f"{name}: the manifest's params are not parameter shapes")
    current = "model.pt"
    try:
        for current in ("model.pt", "optim.pt"):  # whole, also what no table entry reads
            problem = _table_problem(layout.load_file(root / name / current))
            if problem:
                raise CorruptCheckpoint(f"{name}/{current} is not a table of tensors: {problem}")
        current = "model.pt"
        tensors = {**layout.load_tensors(root, manifest, "model")}
        current = "optim.pt"
        tensors.update(layout.load_tensors(root, manifest, "optim"))
        current = "state.pt"
        problem = shared_problem(layout.load_file(root / name / "state.pt"), step, world)
        if problem:
            raise CorruptCheckpoint(f"{name}/state.pt is not a training state: {problem}")
        comms = []
        for rank in range(world):
            current = layout.rank_file(rank)
            per_rank = layout.load_file(root / name / current)
            problem = rank_problem(per_rank, step)
            if problem:
                raise CorruptCheckpoint(f"{name}/{current} is not a rank's training state: {problem}")
            comms.append(per_rank["session"]["comm"])
        disagreement = sync_disagreement(comms)
        if disagreement:
            raise CorruptCheckpoint(f"{name}: the ranks' states disagree: {disagreement}")
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # whatever a crafted file makes torch.load or a decoder raise
        raise CorruptCheckpoint(f"{name}/{current} cannot be loaded ({_first_line(exc)})") from None
    problems = tensor_problems(tensors, params, dtypes)
    if problems:
        raise CorruptCheckpoint(f"{name}: {problems[0]}")


def verify_loadable(root: Path, name: str) -> dict[str, Any]:
    """:func:`~poise.checkpoint.layout.verify` (files and checksums), then :func:`check_contents`;
    returns the manifest.

    Raises:
        CorruptCheckpoint: naming the first file that is missing, altered, or not loadable.
    """
    manifest = layout.verify(root, name)
    check_contents(root, name, manifest)
    return manifest


def newest_loadable(root: Path, below: int | None = None) -> tuple[str, dict[str, Any]] | None:
    """The newest checkpoint (of a step before ``below``, when given) that verifies and loads,
    warning once per one skipped; None if there is none."""
    for step, path in layout.list_checkpoints(root):
        if below is not None and step >= below:
            continue
        try:
            return path.name, verify_loadable(root, path.name)
        except CorruptCheckpoint as exc:
            log.warning("skipping checkpoint %s: %s; trying the previous one", path.name, exc)
    return None
