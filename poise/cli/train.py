"""``poise train``: resolve the config, record it, and launch workers with torch's elastic launcher.

Every worker runs :mod:`poise.runtime.worker` on the resolved ``config.toml``, started by
:func:`poise.cli.launch.launch` (torch.distributed.run, in-process).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

from poise import config as cfg
from poise.cli.flags import add_config_flags, resolve
from poise.cli.launch import launch
from poise.log import make_console

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("train", help="run a distributed training job and measure every rank")
    add_config_flags(parser)
    parser.set_defaults(run=run)


WORKER_MODULE = "poise.runtime.worker"


def default_out_dir() -> str:
    """``runs/<timestamp>`` under the current directory."""
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def record_config(args: argparse.Namespace) -> tuple[cfg.RunConfig, Path]:
    """Resolve the flags into a config with an absolute ``out_dir`` and write ``config.toml`` there."""
    config = resolve(args)
    # Absolute, so workers started from another directory (or node) write to the same place.
    out_dir = str(Path(config.out_dir or default_out_dir()).resolve())
    config = cfg.from_dict(cfg.merge(cfg.to_dict(config), {"out_dir": out_dir}))
    config_path = cfg.save(config, Path(config.out_dir) / "config.toml")
    log.info("resolved config written to %s", config_path)
    return config, config_path.resolve()


def run(args: argparse.Namespace) -> int:
    config, config_path = record_config(args)
    out = Path(config.out_dir)
    code = launch(config.dist, WORKER_MODULE, ["--config", str(config_path)], "poise train")
    report_path = out / "report.json"
    if code == 0 and report_path.exists():
        _show_summary(report_path)
    return code


def _show_summary(report_path: Path) -> None:

    from poise.diagnostics.report import summary_table

    report = json.loads(report_path.read_text())
    console = make_console()
    console.print(summary_table(report))
    out = report_path.parent
    for name in ("config.toml", "report.json", "trace.json", "timeline.png"):
        if (out / name).exists():
            console.print(f"  wrote {out / name}")
