"""How a poise worker process that runs a config starts and ends (``-m poise.train.worker``,
the pipeline's worker), in one place.

Start: read the resolved config, join the process group, check that every rank resolved the
same config, run the job; on any error leave the group without waiting for the others and
re-raise, so torchrun reports this rank's traceback (``@record`` on the caller).

End: the process with ``os._exit`` (after what the worker registered to undo at exit) once everything is
written and the process group is gone (:func:`poise.runtime.dist.exit_process` says why).
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poise import config as config_mod
from poise.config import RunConfig
from poise.log import setup_logging
from poise.runtime import dist as rdist
from poise.runtime.launcher import LAUNCHER_PID_ENV, WORKERS_LOCK, become_worker


def run_config_job(argv: list[str] | None, prog: str, command: str,
                   job: Callable[[RunConfig, rdist.DistContext], Any]) -> int:
    """Parse ``--config FILE`` (written by ``poise COMMAND``), join the group, run ``job``; 0 when done."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help=f"resolved config written by 'poise {command}'")
    args = parser.parse_args(argv)
    become_worker()
    end_quietly_on_signals()
    config = config_mod.load(args.config)
    if not config.out_dir:
        raise ValueError(f"{args.config}: out_dir is empty: the worker needs to know where to write")
    hold_out_dir(Path(config.out_dir))
    # poise.launch.job.CONFIG_HASH_ENV (not imported: a worker needs none of the launcher's code)
    expected = os.environ.get("POISE_CONFIG_HASH")
    if expected and config_mod.config_hash(config) != expected:
        raise ValueError(f"{args.config} is not the config 'poise {command}' resolved for this job: it was "
                         "replaced after the job started (another job on the same --out?)")
    setup_logging(int(os.environ.get("RANK", "0")))
    ctx = rdist.init_from_env(config.dist)
    try:
        rdist.check_config_agreement(config, ctx)
        job(config, ctx)
    except BaseException:
        rdist.close(synchronize=False)
        raise
    rdist.close(synchronize=True)
    return 0


def hold_out_dir(out_dir: Path) -> None:
    """Hold the output directory's workers' lock (:data:`~poise.runtime.launcher.WORKERS_LOCK`,
    shared with the job's other workers) until this process ends, when a poise launcher started
    it: the command's own lock on the directory ends with the command, and a new job must not
    start beside a worker that outlived it. A plain ``torchrun`` start takes nothing.

    Raises:
        ValueError: an exclusive holder (a new job checking for workers) has it for 10 s.
    """
    if os.environ.get(LAUNCHER_PID_ENV):
        from poise.checkpoint.directory import lock

        lock(out_dir, wait_s=10.0, name=WORKERS_LOCK, what="output directory", flag="--out", shared=True)


def end_quietly_on_signals() -> None:
    """End this worker by SIGINT or SIGTERM as the signal's default would, without a traceback.

    torch's agent passes the launcher's Ctrl-C or SIGTERM on to every worker (and SIGTERMs the
    others when one fails): the command prints one line for the whole job, and every worker's
    KeyboardInterrupt traceback would bury it. Nothing is lost: writes are atomic, a half-written
    checkpoint is a partial folder that the next job removes, and the command removes emulation
    cgroups of workers that are gone.
    """
    def end(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, end)


def leave(code: int) -> None:
    """End the process (:func:`~poise.runtime.dist.exit_process`: what the worker registered to
    undo at exit runs first, e.g. an emulated slow rank's cgroup)."""
    rdist.exit_process(code)
