"""``poise train``: resolve the config, record it, launch the workers, show the summary.

Launching is :func:`poise.launch.job.launch_job`: torch's elastic launcher on this machine
(:mod:`poise.launch.elastic`), or with ``--cluster N:M`` one launcher per node of an emulated
cluster (:mod:`poise.launch.cluster_job`). Every worker runs :mod:`poise.train.worker` on the
resolved ``config.toml``. When a worker fails, the launcher stops the others and we exit
non-zero naming the failed rank and its error.

A job owns its output directory: before anything is written there, the command takes the
directory's lock (:data:`JOB_LOCK`, held until it exits), so a second job on the same ``--out``
gets one line and exit 2 instead of replacing the first one's ``config.toml`` under its
workers; and the workers check that the file they read is the config this job resolved (its
hash is handed to them, :data:`poise.launch.job.CONFIG_HASH_ENV`).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise import config as cfg
from poise.cli.flags import add_config_flags, resolve
from poise.log import make_console
from poise.runtime.launcher import WORKERS_LOCK

log = logging.getLogger(__name__)


# What a job may find in its output directory without it being another run's: the config a
# sibling node of the same multi-node job wrote there a moment earlier, and logs whoever started
# the job keeps beside it (``poise bench`` writes ``train.log`` there); poise writes no ``*.log``.
_SHARED_OUTPUTS = {"config.toml"}
# The output directory's lock, held by the job's ``poise`` command while it runs: exclusively by
# a one-machine job; shared by the nodes of a multi-node job, whose commands all write the same
# directory (a one-machine job and a multi-node one exclude each other; two multi-node jobs are
# told apart by the config hash their workers check, and their rank 0s by the checkpoint lock).
JOB_LOCK = ".poise-job.lock"
# Seconds a new job waits for an earlier job's workers to end (those of a command killed
# outright die with it within milliseconds; others are named)
ORPHANS_WAIT_S = 10.0


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("train", help="run a distributed training job and measure every rank")
    add_config_flags(parser)
    add_overwrite_flag(parser)
    parser.set_defaults(run=run)


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out directory, replacing an earlier run's outputs")


def default_out_dir() -> str:
    """A new ``runs/<timestamp>`` under the current directory, created here so that runs started
    in the same second get distinct ones (``-2``, ``-3``... appended)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return str(candidate)
    except OSError as exc:
        raise ValueError(f"cannot create an output directory under {str(base.parent.resolve())!r}: "
                         f"{exc.strerror or exc}: give --out") from None
    raise ValueError(f"no free output directory next to {str(base)!r}: give --out")


def own_out_dir(out_dir: Path, dist: cfg.DistConfig) -> None:
    """Make ``out_dir`` (creating it) this job's: writable, locked until this process exits, and
    with no worker of an earlier job still running there (:data:`WORKERS_LOCK`).

    Raises:
        ValueError: it is a file or under one, cannot be created or written, or another job holds it.
    """
    from poise.checkpoint.directory import check_writable, lock, unlock

    check_writable(out_dir, "output directory", "--out")
    multi_node = dist.nnodes != "1" or bool(dist.rdzv_endpoint)
    lock(out_dir, wait_s=0.0, name=JOB_LOCK, what="output directory", flag="--out", shared=multi_node)
    if not multi_node:
        # Workers of an earlier job may outlive its command (killed outright, they die with it
        # in a moment: poise.runtime.launcher): none may still run when ours start.
        try:
            lock(out_dir, wait_s=ORPHANS_WAIT_S, name=WORKERS_LOCK, what="output directory", flag="--out")
        except ValueError as exc:
            unlock(out_dir, JOB_LOCK)
            raise ValueError(f"{exc} (workers of an earlier job still run there)") from None
        unlock(out_dir, WORKERS_LOCK)


def check_out_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to write over an earlier run's outputs.

    Raises:
        ValueError: ``out_dir`` holds anything but a ``config.toml`` and ``*.log`` files, and neither
            ``resume`` nor ``overwrite`` is set.
    """
    if resume or overwrite or not out_dir.is_dir():
        return
    found = sorted(p.name for p in out_dir.iterdir()
                   if p.name not in _SHARED_OUTPUTS and not (p.suffix == ".log" and p.is_file())
                   and p.name not in (JOB_LOCK, WORKERS_LOCK)
                   # a sibling node writing its config.toml this instant (poise.files' temporary name)
                   and not any(p.name.startswith(f".{name}.") and p.name.endswith(".tmp") for name in _SHARED_OUTPUTS)
                   # a sibling node's empty checkpoint directory (with at most its lock): nothing to overwrite
                   and not (p.is_dir() and {c.name for c in p.iterdir()} <= {".lock"}))
    if found:
        raise ValueError(f"output directory {str(out_dir)!r} already holds a run ({', '.join(found[:4])}"
                         f"{', ...' if len(found) > 4 else ''}): pass --resume to continue it, --overwrite to "
                         "replace it, or give another --out")


def check_parallel(config: cfg.RunConfig) -> None:
    """``poise train`` runs DDP, FSDP2 and HSDP; data x pipeline parallelism is ``poise pipeline``'s.
    A sharded model's codec and collective are checked here too, before any worker starts (the
    same rules :class:`poise.sync.Sharded` applies in every worker), and that the task's optional
    packages are installed.

    Raises:
        ValueError: ``parallel.mode`` is ``dp-pp``, or fsdp/hsdp with a codec or collective
            that only DDP runs, or the task needs a package this environment lacks.
    """
    from poise.comm import registry
    from poise.tasks.registry import check_installed

    check_installed(config.task.name)
    mode, codec = config.parallel.mode, config.comm.codec
    if mode == "dp-pp":
        raise ValueError("parallel.mode='dp-pp' is data x pipeline parallelism: run it with `poise pipeline` "
                         "(poise train takes ddp, fsdp or hsdp)")
    if not config.parallel.sharded:
        return
    if registry.codec(codec).codec is None or codec == "auto":
        raise ValueError(f"comm.codec={codec!r} runs on DDP only (a comm hook, or a dry run over DDP's buckets): with "
                         f"parallel.mode={mode!r} use none, fp16, bf16, int8, topk, sign, randomk or (hsdp) powersgd")
    if codec == "powersgd" and mode == "fsdp":
        raise ValueError("comm.codec='powersgd' needs whole weight matrices, which fsdp's reduce-scatter never "
                         "holds: use parallel.mode=hsdp (powersgd then runs on the all-reduce between shard groups)")
    if config.comm.collective != "flat":
        raise ValueError(f"comm.collective={config.comm.collective!r} with parallel.mode={mode!r}: FSDP2 runs its "
                         "own collectives; use comm.collective=flat (hsdp with a codec compresses between nodes)")


def record_config(args: argparse.Namespace,
                  check: Callable[[cfg.RunConfig], None] | None = None) -> tuple[cfg.RunConfig, Path]:
    """Resolve the flags into a config with an absolute ``out_dir`` and write ``config.toml`` there
    (after ``check``, the command's own refusals, so a refused job writes nothing)."""
    config = resolve(args)
    if check is not None:
        check(config)
    if config.balance.replay:  # read here, bounded, so that a bad file stops no worker but the command
        from poise.balance.replay import load_replans

        nodes = config.dist.nnodes  # (an elastic job's or an emulated cluster's world size is known later)
        known = nodes.isdigit() and not config.cluster.enabled
        load_replans(config.balance.replay, config.dist.nproc * int(nodes) if known else None)
    if config.cluster.enabled:
        from poise.launch import cluster_job  # (torch: imported once the flags and settings are checked)

        if config.cluster.name:
            # An existing cluster's shape and link fill in what the file and flags leave open.
            config = resolve(args, cluster_job.cluster_defaults(config.cluster.name))
        cluster_job.check_job(config)  # before anything is written
    # Absolute, so workers started from another directory (or node) write to the same place.
    out_dir = str(Path(config.out_dir or default_out_dir()).resolve())
    own_out_dir(Path(out_dir), config.dist)  # before anything is written or read there
    if config.out_dir:
        overwrite = getattr(args, "overwrite", False)
        check_out_dir(Path(config.out_dir), resume=config.checkpoint.resume, overwrite=overwrite)
    config = cfg.from_dict(cfg.merge(cfg.to_dict(config), {"out_dir": out_dir}))
    if config.diagnostics.record_samples:  # cut back (resume) or emptied (overwrite) by the workers
        from poise.train.samples import record_problem

        problem = record_problem(Path(out_dir))
        if problem:
            raise ValueError(f"{problem}: remove it, or give another --out")
    if config.checkpoint.resume:
        check_resumable(config)
    else:
        from poise.checkpoint import check_fresh_start

        check_fresh_start(config)
    if config.checkpoint.every_steps:
        from poise.checkpoint.directory import check_directory

        check_directory(Path(config.checkpoint_dir))  # a file in the way fails now, not at the first save
    if config.dist.max_restarts and not config.checkpoint.every_steps:
        log.warning("dist.max_restarts=%d without --checkpoint-every: a restarted job starts over from step 0",
                    config.dist.max_restarts)
    try:
        config_path = cfg.save(config, Path(config.out_dir) / "config.toml")
    except OSError as exc:
        raise ValueError(f"cannot write {str(Path(config.out_dir) / 'config.toml')!r}: {exc.strerror or exc}") from None
    log.info("resolved config written to %s", config_path)
    return config, config_path.resolve()


def run(args: argparse.Namespace) -> int:
    config, config_path = record_config(args, check_parallel)
    from poise.launch.job import launch_job  # torch's launcher: imported once the config is recorded

    out = Path(config.out_dir)
    code = launch_job(config, config_path)
    remove_unfinished_saves(config)
    report_path = out / "report.json"
    if code == 0 and report_path.exists():
        _show_summary(report_path)
    return code


def remove_unfinished_saves(config: cfg.RunConfig) -> None:
    """After a one-machine job's workers are all gone: remove the partial folders of saves they left
    unfinished (a rank stopped mid-save when another failed, e.g. on a full disk), so that they do
    not hold the disk until the next job starts. Nothing is removed while another process holds
    the checkpoint directory's lock; a partial folder is never a checkpoint."""
    from poise.checkpoint.directory import lock, remove_partial, unlock

    root = Path(config.checkpoint_dir)
    multi_node = config.dist.nnodes != "1" or bool(config.dist.rdzv_endpoint) or config.cluster.enabled
    if multi_node or not config.checkpoint.every_steps or not root.is_dir():
        return
    try:
        lock(root, wait_s=0.0)
    except ValueError:
        return  # in use: whoever holds it removes them
    try:
        for path in list(root.iterdir()):  # quietly: the job's last line stays its outcome
            remove_partial(path)
    finally:
        unlock(root)


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

    from poise.decide import describe
    from poise.diagnostics.report import summary_table

    report = json.loads(report_path.read_text())
    console = make_console()
    console.print(summary_table(report))
    if report.get("decisions"):
        console.print("what poise decided (and what pins it):", markup=False)
        for line in describe(report["decisions"]):
            console.print(f"  {line}", markup=False, highlight=False)
    out = report_path.parent
    for name in ("config.toml", "report.json", "trace.json", "timeline.png"):
        if (out / name).exists():
            console.print(f"  wrote {out / name}")
