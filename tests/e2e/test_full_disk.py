"""A sharded job whose checkpoint directory fills up stops in one line and leaves no unfinished
save behind (issue 57, item 18: a ``.partial-step-*`` folder stayed after a disk-full FSDP save,
3 of 3 runs)."""

from __future__ import annotations

import os
import subprocess

import pytest

from poise.checkpoint import layout
from tests.conftest import run_poise
from tests.e2e.test_sharded_train import JOB

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(300)
def test_a_full_disk_during_an_fsdp_save_leaves_no_partial_folder(tmp_path):
    mount = tmp_path / "ckpt"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)],
                                           capture_output=True, timeout=30).returncode:
        pytest.skip("needs root and mount for a small file system")
    try:
        proc = run_poise(*JOB, "--out", str(tmp_path / "out"), "--checkpoint-dir", str(mount), timeout_s=240)
        left = sorted(p.name for p in mount.iterdir())
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "No space left on device" in proc.stderr.strip().splitlines()[-1], proc.stderr[-3000:]
    assert not [name for name in left if name.startswith(layout.PARTIAL_PREFIX)], left
