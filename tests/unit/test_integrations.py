"""The adapters' edges that need no process group: optional imports and one-line refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_poise_imports_without_the_frameworks():
    proc = _python("import sys, poise, poise.integrations; "
                   "assert not {'lightning', 'accelerate'} & set(sys.modules), sorted(sys.modules)")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("adapter", ["lightning", "accelerate"])
def test_an_adapter_without_its_framework_says_what_to_install(adapter):
    proc = _python(f"import sys; sys.modules[{adapter!r}] = None; import poise.integrations.{adapter}")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    version = {"lightning": "2.6.6", "accelerate": "1.15.0"}[adapter]  # pyproject's extras pin them
    assert last == (f"ImportError: poise.integrations.{adapter} needs {adapter}: pip install {adapter}=={version} "
                    f"(poise's '{adapter}' extra)")


def test_attach_refuses_a_single_process_accelerator():
    proc = _python("import torch; from accelerate import Accelerator; from poise.integrations.accelerate import attach;"
                   "attach(Accelerator(cpu=True), torch.nn.Linear(2, 2), batch_size=1)")
    assert proc.returncode == 1
    assert "ValueError: attach(): Accelerate runs a single process here" in proc.stderr.strip().splitlines()[-1]


def test_strategy_refuses_lightnings_own_comm_hook():
    from poise.integrations.lightning import PoiseStrategy

    with pytest.raises(ValueError, match="drop ddp_comm_hook"):
        PoiseStrategy(batch_size=4, ddp_comm_hook=lambda state, bucket: None)
