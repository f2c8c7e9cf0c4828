"""Keeping freed memory (poise/runtime/memory.py): no page faults for a step's large tensors
after the first, and resident memory given back once it outgrows its bound.

mallopt is process-wide, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Eight "steps", each allocating and filling 64 MiB (over glibc's mmap threshold) and freeing
# it: minor page faults of each step, with and without the policy.
_FAULTS = """
import json, resource, sys, torch
from poise.runtime.memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB of float32, every page written
    del x
    if kept is not None:
        kept.after_step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""

# Resident memory that grows past twice its reference is given back: reference from five
# small steps, then a step that leaves 600 MB of freed pages resident.
_TRIM = """
import json, torch
from poise.runtime.memory import keep_freed_memory, resident_bytes
kept = keep_freed_memory()
for _ in range(5):
    kept.after_step()
reference = kept.reference_bytes
held = [torch.ones(2**20) for _ in range(150)]  # 150 x 4 MiB, each page written
big = torch.ones(150 * 2**20)  # 600 MB at the heap's top, above the small ones
del held  # 600 MB of freed pages in the heap's middle, pinned under `big`
grown = resident_bytes()
trimmed = kept.after_step()
print(json.dumps({"reference": reference, "grown": grown, "trimmed": trimmed, "after": resident_bytes(),
                  "trims": kept.trims}))
"""


def _run(script: str, *args: str) -> object:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kept_step_reuses_the_pages_of_the_last_one() -> None:
    plain, kept = _run(_FAULTS, "plain"), _run(_FAULTS, "keep")
    pages = 64 * 2**20 // 4096
    assert min(plain[1:]) > pages // 2, plain  # glibc maps and faults 64 MiB in afresh every step
    assert max(kept[2:]) < pages // 50, kept  # the policy: after two steps of warm-up, the pages are reused


def test_resident_memory_past_its_bound_is_given_back() -> None:
    got = _run(_TRIM)
    assert got["grown"] > 2 * got["reference"], got  # the setup really outgrew the bound
    assert got["trimmed"] and got["trims"] == 1, got
    assert got["after"] < got["grown"] - 400e6, got  # the 600 MB of free pages went back


def test_growth_must_exceed_one() -> None:
    from poise.runtime.memory import keep_freed_memory

    with pytest.raises(ValueError, match=r"growth=1\.0 must be > 1"):
        keep_freed_memory(growth=1.0)
