"""``poise train``: resolve the config, record it, and launch workers with torch's elastic launcher.

The launcher is torch.distributed.run (the code behind ``torchrun``), called in-process with
the same arguments a user would type: standalone rendezvous on one machine, or
``--nnodes/--node-rank/--rdzv-endpoint`` for multi-node jobs; with ``--cluster N:M``, one launcher
per node of an emulated cluster (:mod:`poise.cluster.job`). Every worker runs
:mod:`poise.runtime.worker` on the resolved ``config.toml``. When a worker fails, the
launcher stops the others and we exit non-zero naming the failed rank and its error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
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


WORKER_MODULE = "poise.runtime.worker"


def launcher_args(dist: cfg.DistConfig, config_path: Path | None, module: str = WORKER_MODULE,
                  module_args: Sequence[str] | None = None) -> list[str]:
    """torchrun arguments for one machine's agent (what a user would type after ``torchrun``).

    The workers run ``python -m module --config config_path``, or ``module *module_args``
    when given (``poise diagnose``, whose workers take their own options).
    """
    args = [f"--nproc-per-node={dist.nproc}", f"--nnodes={dist.nnodes}", f"--max-restarts={dist.max_restarts}",
            "--monitor-interval=0.5"]
    if dist.rdzv_endpoint:
        args += [f"--rdzv-backend={dist.rdzv_backend}", f"--rdzv-endpoint={dist.rdzv_endpoint}",
                 f"--rdzv-id={dist.rdzv_id}"]
        if dist.node_rank is not None:
            args.append(f"--node-rank={dist.node_rank}")
        if dist.local_addr:
            args.append(f"--local-addr={dist.local_addr}")
        if dist.rdzv_is_host is not None:
            args.append(f"--rdzv-conf=is_host={int(dist.rdzv_is_host)}")
    elif dist.nnodes != "1":
        raise ValueError(f"dist.nnodes={dist.nnodes!r} needs dist.rdzv_endpoint=HOST:PORT for the rendezvous")
    else:
        args.append("--standalone")
    return [*args, "-m", module, *(module_args if module_args is not None else ["--config", str(config_path)])]


def launch(dist: cfg.DistConfig, config_path: Path | None, *, module: str = WORKER_MODULE, command: str = "train",
           module_args: Sequence[str] | None = None) -> int:
    """Run this machine's workers of ``module`` through torch.distributed.run; returns 0 or 1 (a
    worker failed). ``command`` names the ``poise`` subcommand in the failure message;
    ``module_args`` replace ``--config config_path`` (see :func:`launcher_args`).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    # torchrun would force 1 thread per worker and warn; the worker sets its own count.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if dist.socket_ifname:
        # Without it gloo binds to the address the hostname resolves to, which may be loopback.
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = dist.socket_ifname
    argv = launcher_args(dist, config_path, module, module_args)
    log.info("launching: torchrun %s", " ".join(argv))
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = root_failure(exc)
        sys.stderr.write(
            f"poise {command}: rank {rank} failed (exit code {failure.exitcode}): {_error_line(failure.message)}\n"
        )
        return 1
    return 0


# a rank's error that only reports that a peer went away: a consequence, not a cause
PEER_LOST = re.compile(r"connection (reset|closed) by peer|read error|broken pipe", re.IGNORECASE)


def root_failure(exc: Any) -> tuple[int, Any]:
    """The failure that caused the others: a rank killed by SIGKILL first, then by another signal
    than the launcher's own SIGTERM, then one whose error is not a peer's loss, then the first.

    A worker that is killed writes no error record, so torchelastic stamps its failure only
    when it notices it; by then a peer may have failed with "connection closed by peer" (as
    an exception, or aborting inside gloo) and been stamped earlier: a consequence, not the cause.
    """
    def order(item: tuple[int, Any]) -> tuple[bool, bool, bool, float]:
        failure = item[1]
        signalled = failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
        return (failure.exitcode != -signal.SIGKILL, not signalled, bool(PEER_LOST.search(str(failure.message))),
                failure.timestamp)

    return min(exc.failures.items(), key=order)


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


def record_config(args: argparse.Namespace) -> tuple[cfg.RunConfig, Path]:
    """Resolve the flags into a config with an absolute ``out_dir`` and write ``config.toml`` there."""
    config = resolve(args)
    if config.cluster.enabled:
        from poise.cluster import job as cluster_job

        if config.cluster.name:
            # An existing cluster's shape and link fill in what the file and flags leave open.
            config = resolve(args, cluster_job.cluster_defaults(config.cluster.name))
        cluster_job.check_job(config)  # before anything is written
    # Absolute, so workers started from another directory (or node) write to the same place.
    out_dir = str(Path(config.out_dir or default_out_dir()).resolve())
    config = cfg.from_dict(cfg.merge(cfg.to_dict(config), {"out_dir": out_dir}))
    if config.checkpoint.resume:
        check_resumable(config)
    else:
        from poise.checkpoint import check_fresh_start

        check_fresh_start(config)
    if config.dist.max_restarts and not config.checkpoint.every_steps:
        log.warning("dist.max_restarts=%d without --checkpoint-every: a restarted job starts over from step 0",
                    config.dist.max_restarts)
    config_path = cfg.save(config, Path(config.out_dir) / "config.toml")
    log.info("resolved config written to %s", config_path)
    return config, config_path.resolve()


def launch_job(config: cfg.RunConfig, config_path: Path | None, *, module: str = WORKER_MODULE,
               command: str = "train", module_args: Sequence[str] | None = None) -> int:
    """Run the recorded job: on this machine, or across the nodes of its emulated cluster."""
    if config.cluster.enabled:
        from poise.cluster.job import run_on_cluster

        return run_on_cluster(config, config_path, module=module, command=command, module_args=module_args)
    return launch(config.dist, config_path, module=module, command=command, module_args=module_args)


def run(args: argparse.Namespace) -> int:
    config, config_path = record_config(args)
    out = Path(config.out_dir)
    code = launch_job(config, config_path)
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
