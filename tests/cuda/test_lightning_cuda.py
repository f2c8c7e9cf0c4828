"""The Lightning adapter on ``accelerator="gpu"``: ``PoiseStrategy`` with one GPU (NCCL, a
world of one) trains an epoch with fp16 compression through poise's hook and writes its report.

Accelerate's ``attach`` is not run here: with one GPU, Accelerate's state is a single process
(``DistributedType.NO``), which ``attach`` refuses (``tests/unit/test_integrations.py``), and
two processes cannot share one GPU on NCCL; it needs a machine of two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.cuda.common import CUDA

pytestmark = CUDA


def test_poise_strategy_trains_on_a_gpu(tmp_path: Path):
    pytest.importorskip("lightning")
    paths = [str(ROOT), str(ROOT / "tests" / "e2e" / "scripts"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "cuda" / "lightning_gpu.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 1 and report["backend"] == "nccl" and report["codec"] == "fp16"
    assert report["steps"] > 0 and report["per_rank"][0]["median_compute_s"] > 0
    assert report["comm_raw_bytes_per_step"] > 0  # the buckets went through poise's hook
