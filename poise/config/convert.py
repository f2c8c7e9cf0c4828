"""Config values in and out: TOML and command-line values coerced to field types, nested
dicts to :class:`RunConfig` and back (settings under their former keys read into their place
now), the resolved file every worker loads, and the hash ranks compare at start-up."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from poise.config.dist import NODE_LOCAL_SETTINGS
from poise.config.emulate import FORMER_SECTIONS
from poise.config.run import SECTIONS, RunConfig
from poise.files import write_text_atomic

# The largest integer setting accepted, in magnitude: each ends in a 64-bit integer somewhere.
MAX_INT = 2**63 - 1


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of each field of a config dataclass (strings resolved to types)."""
    return typing.get_type_hints(cls)


def _scalar_type(tp: Any) -> type:
    """``int | None`` -> int; plain types unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner
    return tp


def coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert a TOML or command-line value to a field's type, or raise a one-line error.

    Strings (from the command line) are parsed; TOML values are checked. ``key`` is the
    dotted name used in messages.
    """
    target = _scalar_type(tp)
    if isinstance(value, str) and target is not str:
        text = value.strip().lower()
        try:
            if target is bool:
                if text not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text in ("true", "1", "yes")
            value = target(value)
        except ValueError:
            raise ValueError(f"{key}={value[:80]!r} is not a valid {target.__name__}") from None
    if target is int and isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ValueError(f"{key}={value} is invalid: allowed is at most {MAX_INT} in magnitude")
    if target is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (target is int and isinstance(value, bool)) or not isinstance(value, target):
        raise ValueError(f"{key}={value!r} has the wrong type: expected {target.__name__}")
    return value


def current_layout(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of the nested dict ``data`` with settings given under their former keys moved to
    where they are now: ``balance.rank_speed`` -> ``emulate.rank_speed``, ``straggler.delay``,
    the ``[faults]`` table... (``poise.config.emulate.FORMER_SECTIONS``). Apply it to each layer
    (file, flags) before merging them, so that a flag overrides a file whichever key each used.

    Raises:
        ValueError: one setting given under both keys with different values, or a key of the
            former ``[faults]`` table that never existed.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for name, section in FORMER_SECTIONS.items():
        former = out.get(section)
        if not isinstance(former, dict) or name not in former:
            continue
        value = former.pop(name)
        now = out.setdefault("emulate", {})
        if not isinstance(now, dict):
            continue  # from_dict says what is wrong with it
        if name in now and now[name] != value:
            raise ValueError(f"{section}.{name}={value!r} and emulate.{name}={now[name]!r} are both given: "
                             f"give emulate.{name} only")
        now[name] = value
    faults = out.pop("faults", {})
    if faults:
        key = f"faults.{next(iter(faults))}" if isinstance(faults, dict) else "faults"
        raise ValueError(f"unknown setting {key}: the former [faults] table had fail_at and data_delay_s, "
                         "now in [emulate]")
    return out


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Build a validated RunConfig from a nested dict (TOML layout, former keys accepted:
    :func:`current_layout`); unknown keys are errors."""
    top_types = field_types(RunConfig)
    kwargs: dict[str, Any] = {}
    for key, value in current_layout(data).items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"[{key}] must be a table of settings, not {value!r}")
            cls = SECTIONS[key]
            types_ = field_types(cls)
            for sub in value:
                if sub not in types_:
                    raise ValueError(
                        f"unknown setting {key}.{sub}: allowed in [{key}] are {', '.join(types_)}"
                    )
            kwargs[key] = cls(**{k: coerce(f"{key}.{k}", types_[k], v) for k, v in value.items()})
        elif key in top_types:
            kwargs[key] = coerce(key, top_types[key], value)
        else:
            allowed = ", ".join([k for k in top_types if k not in SECTIONS] + [f"[{s}]" for s in SECTIONS])
            raise ValueError(f"unknown setting {key!r}: allowed at the top level are {allowed}")
    return RunConfig(**kwargs)


def to_dict(config: RunConfig) -> dict[str, Any]:
    """Nested plain dict of every setting; ``None`` (= 'use the default') is left out."""

    def clean(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {
                f.name: clean(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None
            }
        return obj

    return clean(config)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Overlay ``overrides`` (nested) on ``base`` (nested), returning a new dict."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


# A config file is a few kB; a larger one is not a config (and tomllib reads it whole).
MAX_CONFIG_BYTES = 1 << 20


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; a missing, unreadable, oversized or malformed file (a
    directory, a FIFO, nesting deep enough to exhaust the parser) is a one-line ValueError."""
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO is refused below, not waited on
    except FileNotFoundError:
        raise ValueError(f"config file {name!r} does not exist") from None
    except OSError as exc:
        raise ValueError(f"config file {name!r} cannot be read: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ValueError(f"config file {name!r} is {kind}: give a TOML file")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"config file {name!r} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"config file {name!r} is larger than {MAX_CONFIG_BYTES} bytes: not a poise config")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"config file {name!r} is not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"config file {name!r} nests too deeply to be a poise config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {name!r} is not valid TOML: {exc}") from None


def load(path: str | Path) -> RunConfig:
    """Load a resolved config file (as written by :func:`save`)."""
    return from_dict(load_toml(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise TypeError(f"cannot write {value!r} to TOML")


def _toml_string(text: str) -> str:
    r"""``text`` as a TOML basic string of ASCII characters: ``\``, ``"`` and control characters
    escaped, everything past ASCII as ``\uXXXX`` or ``\UXXXXXXXX`` (JSON's escapes would write a
    character outside the Basic Multilingual Plane as two surrogate escapes, which TOML refuses:
    every worker then failed to read the config).

    Raises:
        ValueError: ``text`` holds a lone surrogate (a path's bytes that are not UTF-8), which no
            TOML file can hold.
    """
    out = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= code < 0x7F:
            out.append(char)
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"{text[:200]!r} holds bytes that are not UTF-8 text: a config can hold only "
                             "Unicode text (rename the path, or give another)")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04X}")
        else:
            out.append(f"\\U{code:08X}")
    return '"' + "".join(out) + '"'


def dumps(config: RunConfig) -> str:
    """The config as TOML text (top-level keys first, then one table per section)."""
    data = to_dict(config)

    def line(key: str, value: Any, section: str = "") -> str:
        try:
            return f"{key} = {_toml_value(value)}"
        except ValueError as exc:
            raise ValueError(f"{section + '.' if section else ''}{key}: {exc}") from None

    lines = [line(k, v) for k, v in data.items() if not isinstance(v, dict)]
    for section, values in data.items():
        if isinstance(values, dict):
            lines += ["", f"[{section}]"] + [line(k, v, section) for k, v in values.items()]
    return "\n".join(lines) + "\n"


def save(config: RunConfig, path: str | Path) -> Path:
    """Write the resolved config atomically and return its path."""
    return write_text_atomic(path, dumps(config))


def config_hash(config: RunConfig) -> str:
    """sha256 of the canonical JSON of every setting but the node-local ones; equal on ranks that agree."""
    data = to_dict(config)
    for section, names in NODE_LOCAL_SETTINGS.items():
        for name in names:
            data[section].pop(name, None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
