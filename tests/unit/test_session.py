"""poise.Session's checks that need no process group."""

from __future__ import annotations

import pytest
import torch

import poise


def test_a_session_needs_the_process_group_first():
    with pytest.raises(ValueError, match=r"needs torch.distributed initialised first: call dist.init_process_group"):
        poise.Session(torch.nn.Linear(2, 2), poise.Data(lengths=[1, 2, 3], batch_size=1))


def test_the_public_names_are_documented():
    for name in poise.__all__:
        assert getattr(poise, name).__doc__, name
    for name in ("step", "steps", "state_dict", "load_state_dict", "finish", "dataloader", "settle_buckets"):
        assert getattr(poise.Session, name).__doc__, name
    for name in ("backward", "end", "abort"):
        assert getattr(poise.Step, name).__doc__, name
