"""What every section shares: a field declared with its help text, and the range checks that
give the one-line ``ValueError`` of each section's ``__post_init__``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def setting(default: Any, help: str) -> Any:
    """A dataclass field with ``default`` whose ``help`` text is reused for ``--help``."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_finite(section: str, obj: Any) -> None:
    """Reject ``inf``/``nan`` in every float field of ``obj``: no setting means anything with
    them (``timeout_s=inf`` crashes every worker; ``lr=inf`` or ``grad_clip_norm=nan`` would
    silently stop training or clipping)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{section}.{f.name}={value!r} is invalid: it must be a finite number")


def check_positive(section: str, name: str, value: int | float | None, allow_none: bool = True) -> None:
    """Reject a ``value`` of ``section.name`` that is not above 0 (or None, unless ``allow_none``)."""
    if value is None and allow_none:
        return
    if value is None or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{section}.{name}={value!r} is invalid: it must be a positive number")
