"""Former names, each answered with one line naming the new one (``CHANGELOG.md`` lists them).

Settings, session keywords and modules were renamed or moved before 0.2.0. A script written
against the old names would otherwise stop at Python's bare ``TypeError: unexpected keyword
argument`` or ``ModuleNotFoundError``, with nothing to say what replaced them. Here:

- :data:`FORMER_KEYWORDS`: keywords of ``Session``/``attach``/``PoiseStrategy`` that went
  (``rank_speed`` is now ``emulate``), read by ``Session.from_kwargs``;
- the settings that moved from ``BalanceConfig``/``StragglerConfig`` to ``EmulateConfig``
  (``slowdown_method``, ``delay``, ...: :data:`poise.config.emulate.FORMER_SECTIONS`),
  refused by those classes' constructors with the new place;
- :data:`FORMER_MODULES`: import paths that moved, answered by :class:`FormerModules` (a
  finder ``poise/__init__.py`` puts last on ``sys.meta_path``, so it is asked only for
  modules that exist nowhere).

A file or flag under a former key still loads (``poise.config.convert``): those are read
where they are now, since a recorded run must stay loadable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from poise.config.balance import BalanceConfig
from poise.config.emulate import FORMER_SECTIONS
from poise.config.straggler import StragglerConfig

CHANGES = "renamed in poise 0.2.0, see CHANGELOG.md"

# Session / attach / PoiseStrategy keywords that went -> what replaces them
FORMER_KEYWORDS = {
    "rank_speed": "emulate='RANK:SPEED,...' (or emulate=EmulateConfig(rank_speed=...))",
    "speed_noise": "emulate=EmulateConfig(speed_noise=...)",
    "slowdown_method": "emulate=EmulateConfig(slowdown_method=...)",
    "delay": "emulate=EmulateConfig(delay=...)",
    "backward": "session.backward = fn, set after the session is made (attach sets accelerator.backward)",
    "rank": "nothing: the rank is the process group's",
    "world_size": "nothing: the world size is the process group's",
}

# module paths that moved -> where their contents are now
FORMER_MODULES = {
    "poise.session": "poise.run.session (or poise.Session)",
    "poise.step": "poise.run.step (or poise.Step)",
    "poise.optim": "poise.train.optim",
    "poise.runtime.slowdown": "poise.emulate.speed",
    "poise.runtime.faults": "poise.emulate.faults",
    "poise.runtime.data": "poise.train.data",
    "poise.runtime.entry": "poise.train.entry",
    "poise.runtime.evaluate": "poise.train.evaluate",
    "poise.runtime.samples": "poise.train.samples",
    "poise.runtime.step": "poise.run.step (a step of poise.Session)",
    "poise.runtime.worker": "poise.train.loop (poise train's worker, on poise.Session)",
    "poise.diagnostics.clock": "poise.runtime.clock",
    "poise.diagnostics.marks": "poise.run.marks",
    "poise.plan.step": "poise.plan.step_time",
    "poise.straggler.plan": "poise.straggler.queues",
    "poise.straggler.steps": "poise.sync.deadline.runner",
    "poise.straggler.delays": "poise.emulate.delays",
    "poise.pipeline.plan": "poise.pipeline.stages",
    "poise.cluster.agent": "poise.launch.agent",
    "poise.cluster.job": "poise.launch.cluster_job",
    "poise.config.sections": "poise.config",
}


class FormerName(ValueError, TypeError):
    """A former keyword or setting, with its new name. A ``ValueError`` (one line, exit 2 on
    the command line) that is also the ``TypeError`` an unknown keyword used to raise, so code
    that caught that still does."""


def former_keywords(names: Sequence[str]) -> list[str]:
    """``name: what replaces it`` for each of ``names`` that is a former keyword."""
    return [f"{name} (now {FORMER_KEYWORDS[name]})" for name in names if name in FORMER_KEYWORDS]


def _refuse_moved(cls: type, section: str) -> None:
    """Make ``cls``'s constructor answer a setting that moved to ``[emulate]`` with its new place."""
    moved = frozenset(name for name, former in FORMER_SECTIONS.items() if former == section)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        old = sorted(moved & kwargs.keys())
        if old:
            raise FormerName(f"{cls.__name__}({old[0]}=...) is now EmulateConfig({old[0]}=...) ({CHANGES}): pass "
                             f"Session(..., emulate=EmulateConfig({old[0]}=...)), or [emulate] {old[0]} in a file")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


_refuse_moved(BalanceConfig, "balance")
_refuse_moved(StragglerConfig, "straggler")


class FormerModules:
    """A ``sys.meta_path`` finder, last in line: an import of a module path that moved fails
    with a ``ModuleNotFoundError`` naming where it is now (any other name: not ours)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        new = FORMER_MODULES.get(fullname)
        if new is None:
            return None
        raise ModuleNotFoundError(f"No module named {fullname!r}: it moved to {new} ({CHANGES})", name=fullname)


__all__ = ["CHANGES", "FORMER_KEYWORDS", "FORMER_MODULES", "FormerModules", "FormerName", "former_keywords"]
