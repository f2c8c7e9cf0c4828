"""How every poise worker process starts and ends (``-m poise.runtime.worker``, the pipeline's
worker, ``poise.diagnostics.busbw``), in one place.

Start: read the resolved config, join the process group, check that every rank resolved the
same config, run the job; on any error leave the group without waiting for the others and
re-raise, so torchrun reports this rank's traceback (``@record`` on the caller).

End: leave with ``os._exit`` once everything is written (atomically, fsync'd) and the process
group is gone. With gloo, a background thread still alive when C++ static destructors run
intermittently aborts the process ("terminate called without an active exception"), which
would turn a finished job into a failed one.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from poise import config as config_mod
from poise.config import RunConfig
from poise.log import setup_logging
from poise.runtime import dist as rdist


def run_config_job(argv: list[str] | None, prog: str, command: str,
                   job: Callable[[RunConfig, rdist.DistContext], Any]) -> int:
    """Parse ``--config FILE`` (written by ``poise COMMAND``), join the group, run ``job``; 0 when done."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True, help=f"resolved config written by 'poise {command}'")
    args = parser.parse_args(argv)
    config = config_mod.load(args.config)
    if not config.out_dir:
        raise ValueError(f"{args.config}: out_dir is empty: the worker needs to know where to write")
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


def leave(code: int) -> None:
    """Remove this worker's slowdown cgroup (``atexit`` will not run), flush logs and streams, then
    end the process without static destructors (see above)."""
    from poise.runtime.slowdown import leave_cgroup

    leave_cgroup()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
