"""Command-line flags generated from the config dataclasses.

Every config field is reachable as ``--section.field`` (e.g. ``--train.lr``), with the
field's help text; the everyday ones also have short aliases (``--lr``). Flags are only
recorded when given, so precedence stays defaults < config file < flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from poise import config as cfg

# Short flags for the settings users touch most; each maps to a dotted config key.
ALIASES = {
    "--task": "task.name",
    "--max-seq-len": "task.max_seq_len",
    "--steps": "train.steps",
    "--epochs": "train.epochs",
    "--batch-size": "train.batch_size",
    "--batch-tokens": "train.batch_tokens",
    "--lr": "train.lr",
    "--seed": "train.seed",
    "--nproc": "dist.nproc",
    "--nnodes": "dist.nnodes",
    "--node-rank": "dist.node_rank",
    "--rdzv-endpoint": "dist.rdzv_endpoint",
    "--out": "out_dir",
    "--balance": "balance.strategy",
    "--rank-speed": "balance.rank_speed",
    "--codec": "comm.codec",
    "--topk-ratio": "comm.topk_ratio",
    "--bucket-mb": "comm.bucket_mb",
    "--max-restarts": "dist.max_restarts",
    "--fail-at": "faults.fail_at",
    "--checkpoint-every": "checkpoint.every_steps",
    "--checkpoint-dir": "checkpoint.dir",
}
# On/off switches: --NAME sets the boolean setting true, --no-NAME false.
SWITCHES = {
    "--error-feedback": "comm.error_feedback",
    "--resume": "checkpoint.resume",
    "--checkpoint-async": "checkpoint.async_save",
    "--checkpoint-differential": "checkpoint.differential",
}
_PREFIX = "config:"


def _fields() -> dict[str, tuple[Any, str]]:
    """Dotted key -> (type, help) for every config field."""
    out: dict[str, tuple[Any, str]] = {}
    top = cfg.field_types(cfg.RunConfig)
    for f in dataclasses.fields(cfg.RunConfig):
        if f.name in cfg.SECTIONS:
            section = cfg.SECTIONS[f.name]
            types_ = cfg.field_types(section)
            for sf in dataclasses.fields(section):
                out[f"{f.name}.{sf.name}"] = (types_[sf.name], sf.metadata.get("help", ""))
        else:
            out[f.name] = (top[f.name], f.metadata.get("help", ""))
    return out


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE``, the aliases and every ``--section.field`` flag to ``parser``."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (flags override it)")
    fields = _fields()
    for flag, key in ALIASES.items():
        parser.add_argument(flag, dest=_PREFIX + key, default=argparse.SUPPRESS, metavar="V",
                            help=f"{fields[key][1]} (= --{key})")
    for flag, key in SWITCHES.items():
        negated = "--no-" + flag.removeprefix("--")
        parser.add_argument(flag, dest=_PREFIX + key, action="store_const", const="true", default=argparse.SUPPRESS,
                            help=f"{fields[key][1]} (= --{key} true; {negated} turns it off)")
        parser.add_argument(negated, dest=_PREFIX + key, action="store_const", const="false",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    group = parser.add_argument_group("every setting")
    for key, (_, help_) in fields.items():
        group.add_argument(f"--{key}", dest=_PREFIX + key, default=argparse.SUPPRESS, metavar="V", help=help_)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as a nested dict of raw strings (the config coerces them)."""
    nested: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if not dest.startswith(_PREFIX):
            continue
        section, _, name = dest[len(_PREFIX):].rpartition(".")
        if section:
            nested.setdefault(section, {})[name] = value
        else:
            nested[name] = value
    return nested


def resolve(args: argparse.Namespace) -> cfg.RunConfig:
    """defaults < ``--config`` file < flags, validated (raises one-line ValueError)."""
    base = cfg.load_toml(args.config) if args.config else {}
    return cfg.from_dict(cfg.merge(base, overrides(args)))
