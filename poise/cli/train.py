"""``poise train``: resolve the config, record it, and launch workers with torch's elastic launcher.

The launcher is torch.distributed.run (the code behind ``torchrun``), called in-process with
the same arguments a user would type: standalone rendezvous on one machine, or
``--nnodes/--node-rank/--rdzv-endpoint`` for multi-node jobs. Every worker runs
:mod:`poise.runtime.worker` on the resolved ``config.toml``. When a worker fails, the
launcher stops the others and we exit non-zero naming the failed rank and its error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from poise import config as cfg
from poise.cli.flags import add_config_flags, resolve
from poise.log import make_console

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("train", help="run a distributed training job and measure every rank")
    add_config_flags(parser)
    parser.set_defaults(run=run)


def default_out_dir() -> str:
    """``runs/<timestamp>`` under the current directory."""
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def launcher_args(config: cfg.RunConfig, config_path: Path) -> list[str]:
    """torchrun arguments for this config (what a user would type after ``torchrun``)."""
    d = config.dist
    args = [f"--nproc-per-node={d.nproc}", f"--nnodes={d.nnodes}", f"--max-restarts={d.max_restarts}",
            "--monitor-interval=0.5"]
    if d.rdzv_endpoint:
        args += [f"--rdzv-backend={d.rdzv_backend}", f"--rdzv-endpoint={d.rdzv_endpoint}", f"--rdzv-id={d.rdzv_id}"]
        if d.node_rank is not None:
            args.append(f"--node-rank={d.node_rank}")
    elif d.nnodes != "1":
        raise ValueError(f"dist.nnodes={d.nnodes!r} needs dist.rdzv_endpoint=HOST:PORT for the rendezvous")
    else:
        args.append("--standalone")
    return [*args, "-m", "poise.runtime.worker", "--config", str(config_path)]


def launch(config: cfg.RunConfig, config_path: Path) -> int:
    """Run the workers through torch.distributed.run; returns 0 or 1 (a worker failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    # torchrun would force 1 thread per worker and warn; the worker sets its own count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    argv = launcher_args(config, config_path)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        sys.stderr.write(
            f"poise train: rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}\n"
        )
        return 1
    return 0


def _error_line(message: object) -> str:
    """The exception line from a torchelastic failure message (a JSON error record when the
    worker used ``@record``, plain text otherwise)."""
    if isinstance(message, str):
        try:
            message = json.loads(message)
        except ValueError:
            pass
    if isinstance(message, dict):
        message = message.get("message", message)
    text = str(message).strip()
    return text.splitlines()[0] if text else "(no message)"


def run(args: argparse.Namespace) -> int:
    config = resolve(args)
    # Absolute, so workers started from another directory (or node) write to the same place.
    out_dir = str(Path(config.out_dir or default_out_dir()).resolve())
    config = cfg.from_dict(cfg.merge(cfg.to_dict(config), {"out_dir": out_dir}))
    out = Path(config.out_dir)
    if config.checkpoint.resume:
        check_resumable(config)
    else:
        from poise.checkpoint import check_fresh_start

        check_fresh_start(config)
    if config.dist.max_restarts and not config.checkpoint.every_steps:
        log.warning("dist.max_restarts=%d without --checkpoint-every: a restarted job starts over from step 0",
                    config.dist.max_restarts)
    config_path = cfg.save(config, out / "config.toml")
    log.info("resolved config written to %s", config_path)
    code = launch(config, config_path.resolve())
    report_path = out / "report.json"
    if code == 0 and report_path.exists():
        _show_summary(report_path)
    return code


def check_resumable(config: cfg.RunConfig) -> None:
    """Fail before launching when ``--resume`` has nothing to resume from.

    Raises:
        ValueError: the checkpoint directory is missing or holds no complete checkpoint.
    """
    from poise.checkpoint.layout import CorruptCheckpoint, list_checkpoints, read_manifest
    from poise.checkpoint.state import config_problems

    root = Path(config.checkpoint_dir)
    if not root.is_dir():
        raise ValueError(f"--resume: the checkpoint directory {str(root)!r} does not exist (see --checkpoint-dir)")
    found = list_checkpoints(root)
    if not found:
        raise ValueError(f"--resume: {str(root)!r} holds no checkpoint")
    for _, path in found:  # the newest readable manifest; the workers verify every file
        try:
            manifest = read_manifest(path)
        except CorruptCheckpoint:
            continue
        problems = config_problems(manifest, config)
        if problems:
            raise ValueError(f"--resume: checkpoint {path} does not fit this run: {'; '.join(problems[:3])}"
                             f"{f' (+{len(problems) - 3} more)' if len(problems) > 3 else ''}")
        return


def _show_summary(report_path: Path) -> None:

    from poise.diagnostics.report import summary_table

    report = json.loads(report_path.read_text())
    console = make_console()
    console.print(summary_table(report))
    out = report_path.parent
    for name in ("config.toml", "report.json", "trace.json", "timeline.png"):
        if (out / name).exists():
            console.print(f"  wrote {out / name}")
