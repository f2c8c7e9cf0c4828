"""``poise checkpoint list DIR [--json]`` and ``poise checkpoint verify DIR``: what a checkpoint
directory holds and whether it can be resumed from, without starting a job.

``list`` shows every checkpoint folder, newest first: its step, kind (full, or differential and
the full base it builds on), the bytes of its files on disk, and whether it verifies (every
file of it and of its bases matches the manifest's size and sha256, none is a symbolic link,
and every file loads as a resume loads it: :func:`poise.checkpoint.contents.verify_loadable`). ``verify`` exits 0 when
the newest checkpoint verifies, 1 (with the reason, one line) when it does not, so that a
script can check a directory before it resumes from it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from poise.log import make_console


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("checkpoint", help="list or verify the checkpoints in a directory")
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))
    listing = actions.add_parser("list", help="every checkpoint: step, kind, bytes, whether it verifies")
    listing.add_argument("dir", help="checkpoint directory (<out>/checkpoints by default)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    listing.set_defaults(run=run_list)
    verify = actions.add_parser("verify", help="exit 0 when the newest checkpoint verifies, 1 when it does not")
    verify.add_argument("dir", help="checkpoint directory")
    verify.set_defaults(run=run_verify)


def _root(text: str) -> Path:
    root = Path(text)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {text!r} does not exist or is not a directory")
    return root


def describe(root: Path) -> list[dict[str, Any]]:
    """One row per checkpoint folder, newest first: ``step``, ``name``, ``kind``, ``base`` (the
    oldest full checkpoint a differential builds on, else None), ``bytes`` (its files on
    disk), ``verified`` and ``error`` (why it does not verify, else '')."""
    from poise.checkpoint import contents, layout  # torch is imported only when a command runs

    rows = []
    for step, path in layout.list_checkpoints(root):
        files = [] if path.is_symlink() else list(path.iterdir())
        row: dict[str, Any] = {"step": step, "name": path.name, "kind": None, "base": None,
                               "bytes": sum(f.lstat().st_size for f in files if not f.is_symlink() and f.is_file()),
                               "verified": False, "error": ""}
        try:
            manifest = layout.read_manifest(path)
            row["kind"] = manifest["kind"]
            bases = sorted(set(manifest["bases"]) - {path.name})
            row["base"] = bases[0] if bases else None
            contents.verify_loadable(root, path.name)
            row["verified"] = True
        except layout.CorruptCheckpoint as exc:
            row["error"] = str(exc)
        rows.append(row)
    return rows


def run_list(args: argparse.Namespace) -> int:
    rows = describe(_root(args.dir))
    if args.json:
        sys.stdout.write("".join(json.dumps(row) + "\n" for row in rows))
        return 0
    from rich.table import Table

    table = Table(title=f"checkpoints in {args.dir}")
    for header in ("step", "kind", "base", "MB", "verified"):
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(str(row["step"]), row["kind"] or "?", row["base"] or "-", f"{row['bytes'] / 1e6:.2f}",
                      "yes" if row["verified"] else f"no: {row['error']}")
    make_console().print(table)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from poise.checkpoint import contents, layout

    root = _root(args.dir)
    found = layout.list_checkpoints(root)
    if not found:
        sys.stderr.write(f"poise checkpoint verify: {args.dir} holds no checkpoint\n")
        return 1
    name = found[0][1].name
    try:
        contents.verify_loadable(root, name)
    except layout.CorruptCheckpoint as exc:
        sys.stderr.write(f"poise checkpoint verify: newest checkpoint {name} does not verify: {exc}\n")
        return 1
    make_console().print(f"{name} verifies")
    return 0
