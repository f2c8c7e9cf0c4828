"""Every run setting, in one typed, validated, recorded place.

A run is described by a frozen :class:`RunConfig` made of small sections. Values come from
defaults < a TOML file < command-line flags, are validated once here (one-line
``ValueError`` naming the bad value and what is allowed), and the resolved result is written
next to the outputs as ``config.toml``. Workers load that file, so what ran is exactly what
was recorded, and its hash is compared across ranks at start-up.

Units are part of field names (``_s`` seconds, ``_bytes`` bytes, ``_steps`` steps). Each
field's help text lives in its metadata and is reused for ``--help``.

The package has two modules: ``sections.py`` (the settings and their checks) and
``convert.py`` (values in and out: TOML, dicts, the recorded file, the hash). Everything is
imported from here: ``from poise import config as cfg; cfg.RunConfig, cfg.load(...)``.
"""

from poise.config.convert import (
    coerce,
    config_hash,
    dumps,
    field_types,
    from_dict,
    load,
    load_toml,
    merge,
    save,
    to_dict,
)
from poise.config.sections import (
    BACKENDS,
    BALANCE_STRATEGIES,
    CODEC_NAMES,
    COLLECTIVE_NAMES,
    DEFAULT_LINK,
    DELTA_CODECS,
    LOSSY_CODECS,
    MAX_LOCAL_WORKERS,
    NODE_LOCAL_SETTINGS,
    PARTITION_METHODS,
    PIPELINE_SCHEDULES,
    SECTIONS,
    TASK_NAMES,
    VARIANCE_FREEZING_CODECS,
    BalanceConfig,
    CheckpointConfig,
    ClusterConfig,
    CommConfig,
    DiagnosticsConfig,
    DistConfig,
    FaultConfig,
    MetricsConfig,
    PipelineConfig,
    RunConfig,
    StragglerConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "BACKENDS",
    "BALANCE_STRATEGIES",
    "CODEC_NAMES",
    "COLLECTIVE_NAMES",
    "DEFAULT_LINK",
    "DELTA_CODECS",
    "LOSSY_CODECS",
    "MAX_LOCAL_WORKERS",
    "NODE_LOCAL_SETTINGS",
    "PARTITION_METHODS",
    "PIPELINE_SCHEDULES",
    "SECTIONS",
    "TASK_NAMES",
    "VARIANCE_FREEZING_CODECS",
    "BalanceConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CommConfig",
    "DiagnosticsConfig",
    "DistConfig",
    "FaultConfig",
    "MetricsConfig",
    "PipelineConfig",
    "RunConfig",
    "StragglerConfig",
    "TaskConfig",
    "TrainConfig",
    "coerce",
    "config_hash",
    "dumps",
    "field_types",
    "from_dict",
    "load",
    "load_toml",
    "merge",
    "save",
    "to_dict",
]
