"""Where a recorded job runs: on this machine, or across the nodes of its emulated cluster.

The commands resolve and record the config first (``poise/cli/``); this only starts the
workers and returns the exit code that the command returns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from poise.config import RunConfig, config_hash
from poise.launch.cluster_job import run_on_cluster
from poise.launch.elastic import WORKER_MODULE, launch

# The hash (:func:`poise.config.config_hash`) of the config this job resolved, handed to its
# workers (inherited through the launchers' environment), which check the file they read
# against it: a config file replaced under a running job is named, never trained on.
CONFIG_HASH_ENV = "POISE_CONFIG_HASH"


def launch_job(config: RunConfig, config_path: Path | None, *, module: str = WORKER_MODULE,
               command: str = "train", module_args: Sequence[str] | None = None) -> int:
    """Run the workers of ``module`` for the job of ``config`` (saved at ``config_path``): on
    this machine, or on its emulated cluster when ``config.cluster`` asks for one.

    ``command`` names the ``poise`` subcommand in failure messages; ``module_args`` replace
    ``--config config_path`` on the workers' command line (``poise diagnose``).

    Returns:
        0, or 1 when a worker (or a node's agent) failed; a line naming it went to stderr.
    """
    if config_path is not None:
        os.environ[CONFIG_HASH_ENV] = config_hash(config)
    else:
        os.environ.pop(CONFIG_HASH_ENV, None)
    if config.cluster.enabled:
        return run_on_cluster(config, config_path, module=module, command=command, module_args=module_args)
    return launch(config.dist, config_path, module=module, command=command, module_args=module_args)
