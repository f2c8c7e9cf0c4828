"""Every run setting, in one typed, validated, recorded place.

A run is described by a frozen :class:`RunConfig` made of small sections. Values come from
defaults < a TOML file < command-line flags, are validated once here (one-line
``ValueError`` naming the bad value and what is allowed), and the resolved result is written
next to the outputs as ``config.toml``. Workers load that file, so what ran is exactly what
was recorded, and its hash is compared across ranks at start-up.

Units are part of field names (``_s`` seconds, ``_bytes`` bytes, ``_steps`` steps). Each
field's help text lives in its metadata and is reused for ``--help``.

One module per section (``task.py``, ``train.py``, ``dist.py``, ``balance.py``, ``comm.py``,
``straggler.py``, ``sync.py``, ``parallel.py``, ``cluster.py``, ``diagnostics.py``, ``metrics.py``, ``emulate.py``,
``checkpoint.py``, ``pipeline.py``), ``run.py`` for the whole run and its cross-section checks,
``fields.py`` for what the sections share, ``convert.py`` for values in and out (TOML,
dicts, former keys, the recorded file, the hash), and ``former.py`` for the names that went
(a former keyword, setting or module answered with its new name). The config imports nothing of poise but
``poise.units`` and ``poise.files``: names that belong to other packages (codecs, collectives)
are checked by them (``poise.comm.registry.check``). Everything is imported from here:
``from poise import config as cfg; cfg.RunConfig, cfg.load(...)``.
"""

from poise.config.balance import BALANCE_STRATEGIES, BalanceConfig
from poise.config.checkpoint import CheckpointConfig
from poise.config.cluster import DEFAULT_LINK, MAX_NODES, ClusterConfig, validate_name
from poise.config.comm import CommConfig
from poise.config.convert import (
    coerce,
    config_hash,
    current_layout,
    dumps,
    field_types,
    from_dict,
    load,
    load_toml,
    merge,
    save,
    to_dict,
)
from poise.config.diagnostics import DiagnosticsConfig
from poise.config.dist import BACKENDS, MAX_LOCAL_WORKERS, NODE_LOCAL_SETTINGS, DistConfig
from poise.config.emulate import FORMER_SECTIONS, DelaySpec, EmulateConfig
from poise.config.former import FORMER_KEYWORDS, FORMER_MODULES, FormerModules, FormerName, former_keywords
from poise.config.metrics import MetricsConfig
from poise.config.parallel import PARALLEL_MODES, SHARDED_MODES, ParallelConfig
from poise.config.pipeline import PARTITION_METHODS, PIPELINE_SCHEDULES, PipelineConfig
from poise.config.run import SECTIONS, RunConfig
from poise.config.straggler import STRAGGLER_MODES, StragglerConfig
from poise.config.sync import OUTER_CODECS, OUTER_MODES, SYNC_MODES, SyncConfig
from poise.config.task import TASK_NAMES, TaskConfig
from poise.config.train import TrainConfig

__all__ = [
    "BACKENDS",
    "BALANCE_STRATEGIES",
    "DEFAULT_LINK",
    "FORMER_KEYWORDS",
    "FORMER_MODULES",
    "FORMER_SECTIONS",
    "MAX_LOCAL_WORKERS",
    "MAX_NODES",
    "NODE_LOCAL_SETTINGS",
    "OUTER_CODECS",
    "OUTER_MODES",
    "PARALLEL_MODES",
    "PARTITION_METHODS",
    "PIPELINE_SCHEDULES",
    "SECTIONS",
    "SHARDED_MODES",
    "STRAGGLER_MODES",
    "SYNC_MODES",
    "TASK_NAMES",
    "BalanceConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CommConfig",
    "DelaySpec",
    "DiagnosticsConfig",
    "DistConfig",
    "EmulateConfig",
    "FormerModules",
    "FormerName",
    "MetricsConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RunConfig",
    "StragglerConfig",
    "SyncConfig",
    "TaskConfig",
    "TrainConfig",
    "coerce",
    "config_hash",
    "current_layout",
    "dumps",
    "field_types",
    "former_keywords",
    "from_dict",
    "load",
    "load_toml",
    "merge",
    "save",
    "to_dict",
    "validate_name",
]
