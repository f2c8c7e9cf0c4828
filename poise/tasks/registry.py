"""The one name → task builder table, used once when a worker starts."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from poise.config import TASK_NAMES, RunConfig
from poise.tasks.base import Task


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/poise`` or ``~/.cache/poise``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "poise"


def _cache_dir(config: RunConfig) -> Path:
    return Path(config.task.cache_dir) if config.task.cache_dir else default_cache_dir()


def _code_lm(config: RunConfig) -> Task:
    from poise.tasks.code_lm import build_code_lm_task

    t = config.task
    return build_code_lm_task(
        max_seq_len=t.max_seq_len,
        d_model=t.d_model,
        num_layers=t.num_layers,
        num_heads=t.num_heads,
        cache_dir=_cache_dir(config),
        seed=config.train.seed,
        packed=t.packed,
    )


def _digits(config: RunConfig) -> Task:
    from poise.tasks.digits import build_digits_task

    return build_digits_task(seed=config.train.seed, cache_dir=_cache_dir(config))


TASKS: dict[str, Callable[[RunConfig], Task]] = {"code-lm": _code_lm, "digits": _digits}
assert tuple(TASKS) == TASK_NAMES, "config.TASK_NAMES and TASKS must list the same tasks"


# What a task imports beyond poise's own dependencies: (module, the package that installs it).
# poise's ``tasks`` extra installs them all (pyproject.toml).
NEEDS: dict[str, tuple[str, str]] = {"digits": ("sklearn", "scikit-learn")}


def check_installed(name: str) -> None:
    """Fail in one line, before any worker starts, when task ``name`` needs a package that this
    environment lacks (poise installs into a user's own environment without its optional extras).

    Raises:
        ValueError: naming the task, the missing package and how to install it.
    """
    if name in NEEDS and importlib.util.find_spec(NEEDS[name][0]) is None:
        package = NEEDS[name][1]
        raise ValueError(f"task.name={name!r} needs {package}, which is not installed: pip install {package} "
                         "(or poise's 'tasks' extra)")


def build_task(config: RunConfig) -> Task:
    """Build the configured task (the name was validated by the config)."""
    check_installed(config.task.name)
    return TASKS[config.task.name](config)
