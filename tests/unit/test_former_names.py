"""Names that went before 0.2.0 (issue 57, item 8): a former session keyword, a setting that
moved to ``EmulateConfig`` and a module path that moved are each answered with one line
naming the new one, not Python's bare TypeError or ModuleNotFoundError; and the config's
refusal of a per-step codec an outer mode never uses (item 3)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from torch import nn

import poise
from poise.config import FORMER_KEYWORDS, FORMER_MODULES, FORMER_SECTIONS, FormerName

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("cls", "name"), [(poise.BalanceConfig, "slowdown_method"),
                                           (poise.BalanceConfig, "rank_speed"),
                                           (poise.StragglerConfig, "delay")])
def test_a_setting_that_moved_to_emulate_names_its_new_place(cls, name):
    with pytest.raises(TypeError) as info:  # still the TypeError it was, now a ValueError too
        cls(**{name: "x"})
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert str(info.value).startswith(f"{cls.__name__}({name}=...) is now EmulateConfig({name}=...)")


def test_an_unknown_setting_is_still_pythons_error():
    with pytest.raises(TypeError) as info:
        poise.BalanceConfig(no_such_setting=1)
    assert not isinstance(info.value, FormerName)


def test_a_former_session_keyword_names_its_replacement():
    """``attach(..., rank_speed=...)`` and every adapter go through Session.from_kwargs, which
    answers before any process group is needed."""
    with pytest.raises(ValueError, match=r"^session keyword\(s\) rank_speed \(now emulate='RANK:SPEED,\.\.\.'"):
        poise.Session.from_kwargs(nn.Linear(2, 1), lengths=[1, 2], batch_size=1, rank_speed="1:0.5")


@pytest.mark.parametrize("old", ["poise.session", "poise.runtime.slowdown", "poise.plan.step"])
def test_a_module_that_moved_names_where_it_is(old):
    expected = f"No module named '{old}': it moved to {FORMER_MODULES[old]}"
    with pytest.raises(ModuleNotFoundError, match=re.escape(expected)):
        importlib.import_module(old)


def test_every_moved_module_exists_and_no_former_name_is_current():
    for new in FORMER_MODULES.values():
        importlib.import_module(new.split(" ")[0])
    for old in FORMER_MODULES:
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists() and not (ROOT / old.replace(".", "/")).is_dir()
    current = set(poise.run.data.DATA_FIELDS) | set(poise.run.session.SESSION_KEYWORDS)
    assert not current & set(FORMER_KEYWORDS) and set(FORMER_SECTIONS) <= set(FORMER_KEYWORDS) | {"speed_noise_steps",
                                                                                                  "fail_at",
                                                                                                  "data_delay_s"}


def test_the_changelog_lists_the_renames():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## 0.2.0 (unreleased)" in text
    for name in ("rank_speed", "slowdown_method", "delay", "poise.session"):
        assert name in text


def test_a_per_step_codec_under_an_outer_mode_is_refused_by_the_config():
    """``poise train --sync diloco --codec fp16``: refused when the config is resolved, before a
    worker starts (issue 57, item 3; the session refuses it too: tests/dist/test_session_misuse.py)."""
    from poise.config import from_dict

    with pytest.raises(ValueError, match=r"^comm.codec='fp16' compresses the per-step gradient all-reduce, which "
                                         r"sync.mode='diloco' never runs"):
        from_dict({"sync": {"mode": "diloco"}, "comm": {"codec": "fp16"}})
    from_dict({"sync": {"mode": "diloco", "warmup_steps": 5}, "comm": {"codec": "fp16"}})  # the warm-up uses it


def test_a_former_keyword_of_the_lightning_strategy_names_its_replacement():
    """Lightning would hand an unknown keyword to DDP, which fails far from the cause."""
    pytest.importorskip("lightning")
    from poise.integrations.lightning import PoiseStrategy

    with pytest.raises(ValueError, match=r"^PoiseStrategy: keyword\(s\) rank_speed \(now emulate="):
        PoiseStrategy(lengths=[1, 2], batch_size=1, rank_speed="1:0.5")
