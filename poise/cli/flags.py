"""Command-line flags generated from the config dataclasses.

Every config field is reachable as ``--section.field`` (e.g. ``--train.lr``), with the
field's help text; the everyday ones also have short aliases (``--lr``), and settings that
moved keep their former flags (``--balance.rank_speed`` is ``--emulate.rank_speed``). Flags
are only recorded when given, so precedence stays defaults < config file < flags. The names a
codec or collective setting allows are the comm registry's: listed in the help from it, and
checked by it in :func:`resolve`. The registry is read from the codecs themselves, which import
torch (about 2 s): it is imported when the help is printed or a resolved config is checked, so
a bad flag or setting is refused without it.
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
    "--rank-speed": "emulate.rank_speed",
    "--codec": "comm.codec",
    "--straggler": "straggler.mode",
    "--sync": "sync.mode",
    "--parallel": "parallel.mode",
    "--delay": "emulate.delay",
    "--topk-ratio": "comm.topk_ratio",
    "--collective": "comm.collective",
    "--bucket-mb": "comm.bucket_mb",
    "--link": "cluster.link",
    "--max-restarts": "dist.max_restarts",
    "--fail-at": "emulate.fail_at",
    "--checkpoint-every": "checkpoint.every_steps",
    "--checkpoint-dir": "checkpoint.dir",
}
# The value each alias takes, as --help and the reference show it (a setting without one here is
# named by its type: N, X, TEXT, true|false).
METAVARS = {
    "--task": "NAME", "--max-seq-len": "BYTES", "--nnodes": "NODES", "--node-rank": "RANK",
    "--rdzv-endpoint": "HOST:PORT", "--out": "DIR", "--balance": "STRATEGY", "--rank-speed": "RANK:SPEED,...",
    "--codec": "CODEC", "--straggler": "MODE", "--sync": "MODE", "--parallel": "MODE", "--delay": "SPEC",
    "--topk-ratio": "RATIO", "--collective": "NAME", "--bucket-mb": "MB", "--link": "RATE",
    "--fail-at": "RANK:STEP", "--checkpoint-dir": "DIR", "--lr": "LR", "--schedule": "NAME", "--partition": "METHOD",
}
# On/off switches: --NAME sets the boolean setting true, --no-NAME false.
SWITCHES = {
    "--error-feedback": "comm.error_feedback",
    "--resume": "checkpoint.resume",
    "--checkpoint-async": "checkpoint.async_save",
    "--checkpoint-differential": "checkpoint.differential",
}
# Two settings in one flag: "A:B" sets the first key to A and the second to B; "A" the first only.
# flag -> (keys, metavar, help)
PAIRS = {
    "--cluster": (("cluster.nodes", "dist.nproc"), "N[:M]", "run on an emulated cluster of N nodes, M workers each"),
}
_PREFIX = "config:"
_PAIR_PREFIX = "pair:"


# The settings whose names a registry holds; their help ends with the names allowed.
NAMED = ("comm.codec", "comm.collective", "checkpoint.delta_codec")


def _allowed_names() -> dict[str, tuple[str, ...]]:
    """Dotted key -> the names it allows, for the settings whose names a registry holds."""
    from poise.comm import registry

    return {"comm.codec": tuple(registry.CODECS), "comm.collective": tuple(registry.COLLECTIVES),
            "checkpoint.delta_codec": registry.delta_codec_names()}


class _Allowed:
    """A setting's allowed names, as its help's ``%(allowed)s`` (argparse expands a help from
    the action's attributes when it prints it): read from the registry then, not at start-up."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __str__(self) -> str:
        return ", ".join(_allowed_names()[self.key])


def _add(container: Any, *names: str, key: str, **kwargs: Any) -> None:
    """``container.add_argument(*names, **kwargs)``, whose help may name ``key``'s allowed names."""
    action = container.add_argument(*names, **kwargs)
    if key in NAMED:
        action.allowed = _Allowed(key)


def _fields() -> dict[str, tuple[Any, str]]:
    """Dotted key -> (type, help) for every config field (help escaped for argparse's %-formatting)."""
    out: dict[str, tuple[Any, str]] = {}
    top = cfg.field_types(cfg.RunConfig)
    for f in dataclasses.fields(cfg.RunConfig):
        if f.name in cfg.SECTIONS:
            section = cfg.SECTIONS[f.name]
            types_ = cfg.field_types(section)
            for sf in dataclasses.fields(section):
                key, help_ = f"{f.name}.{sf.name}", sf.metadata.get("help", "")
                allowed = "; allowed: %(allowed)s" if key in NAMED else ""  # (see _Allowed)
                out[key] = (types_[sf.name], help_.replace("%", "%%") + allowed)
        else:
            out[f.name] = (top[f.name], f.metadata.get("help", "").replace("%", "%%"))
    return out


def value_name(kind: Any) -> str:
    """The value a setting of type ``kind`` takes, by its type (``int | None`` -> ``N``)."""
    names = {str(part).strip() for part in str(getattr(kind, "__name__", kind)).split("|")} - {"None"}
    for name, shown in (("bool", "true|false"), ("int", "N"), ("float", "X")):
        if name in names or f"<class '{name}'>" in names:
            return shown
    return "TEXT"


def add_config_flags(parser: argparse.ArgumentParser, extra_aliases: dict[str, str] | None = None) -> None:
    """Add ``--config FILE``, the aliases (plus a command's own ``extra_aliases``) and every
    ``--section.field`` flag to ``parser``."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file (flags override it)")
    fields = _fields()
    for flag, key in {**ALIASES, **(extra_aliases or {})}.items():
        _add(parser, flag, key=key, dest=_PREFIX + key, default=argparse.SUPPRESS,
             metavar=METAVARS.get(flag, value_name(fields[key][0])), help=f"{fields[key][1]} (= --{key})")
    for flag, key in SWITCHES.items():
        negated = "--no-" + flag.removeprefix("--")
        parser.add_argument(flag, dest=_PREFIX + key, action="store_const", const="true", default=argparse.SUPPRESS,
                            help=f"{fields[key][1]} (= --{key} true; {negated} turns it off)")
        parser.add_argument(negated, dest=_PREFIX + key, action="store_const", const="false",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flag, ((first, second), metavar, help_) in PAIRS.items():
        a, b = metavar.replace("[", "").replace("]", "").split(":")  # "N[:M]" -> N, M
        parser.add_argument(flag, dest=_PAIR_PREFIX + flag, default=argparse.SUPPRESS, metavar=metavar,
                            help=f"{help_} (= --{first} {a} --{second} {b})")
    group = parser.add_argument_group("every setting")
    for key, (kind, help_) in fields.items():
        _add(group, f"--{key}", key=key, dest=_PREFIX + key, default=argparse.SUPPRESS, metavar=value_name(kind),
             help=help_)
    for name, former in cfg.FORMER_SECTIONS.items():  # the former spellings, still accepted (not listed)
        parser.add_argument(f"--{former}.{name}", dest=f"{_PREFIX}emulate.{name}", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that were given, as a nested dict of raw strings (the config coerces them)."""
    given = {dest[len(_PREFIX):]: value for dest, value in vars(args).items() if dest.startswith(_PREFIX)}
    for dest, value in vars(args).items():
        if not dest.startswith(_PAIR_PREFIX):
            continue
        flag = dest[len(_PAIR_PREFIX):]
        parts = str(value).split(":")
        if len(parts) > 2 or not all(p.strip() for p in parts):
            raise ValueError(f"{flag} {value!r} is invalid: give {PAIRS[flag][1]}")
        for key, part in zip(PAIRS[flag][0], parts, strict=False):
            if given.setdefault(key, part) != part:
                raise ValueError(f"{flag} {value!r} sets {key}={part}, but --{key} {given[key]} is given too")
    nested: dict[str, Any] = {}
    for key, value in given.items():
        section, _, name = key.rpartition(".")
        if section:
            nested.setdefault(section, {})[name] = value
        else:
            nested[name] = value
    return nested


def resolve(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> cfg.RunConfig:
    """defaults < ``--config`` file < ``defaults`` (nested, e.g. an existing cluster's shape) < flags,
    validated, codec and collective names included (raises one-line ValueError)."""
    layers = [cfg.load_toml(args.config) if args.config else {}, defaults or {}, overrides(args)]
    merged: dict[str, Any] = {}
    for layer in layers:  # each read into today's keys first, so that a flag beats a file's former key
        merged = cfg.merge(merged, cfg.current_layout(layer))
    config = cfg.from_dict(merged)
    from poise.comm import registry  # after the config's own checks: it imports torch (see module doc)

    registry.check(config.comm, config.checkpoint)
    return config
