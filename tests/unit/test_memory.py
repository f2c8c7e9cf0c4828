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

# Resident memory past the limit is given back: a limit 300 MB over the start, then a step
# that leaves 600 MB of freed pages resident.
_TRIM = """
import json, torch
from poise.runtime.memory import keep_freed_memory, resident_bytes
start = resident_bytes()
kept = keep_freed_memory(limit_bytes=start + 300 * 10**6)
quiet = kept.after_step()
held = [torch.ones(2**20) for _ in range(150)]  # 150 x 4 MiB, each page written
big = torch.ones(150 * 2**20)  # 600 MB at the heap's top, above the small ones
del held  # 600 MB of freed pages in the heap's middle, pinned under `big`
grown = resident_bytes()
trimmed = kept.after_step()
print(json.dumps({"quiet": quiet, "limit": kept.limit_bytes, "grown": grown, "trimmed": trimmed,
                  "after": resident_bytes(), "trims": kept.trims}))
"""


def _run(script: str, *args: str) -> object:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kept_step_reuses_the_pages_of_the_last_one() -> None:
    plain, kept = _run(_FAULTS, "plain"), _run(_FAULTS, "keep")
    pages = 64 * 2**20 // 4096
    assert min(plain[1:]) > pages // 2, plain  # glibc maps and faults 64 MiB in afresh every step
    # the policy: the pages are reused. A small allocation can split the freed block once early
    # on, and the next step maps afresh (seen once, at the third step of a loaded suite run)
    fresh = [f for f in kept[1:] if f >= pages // 50]
    assert len(fresh) <= 1 and max(kept[-4:]) < pages // 50, kept


def test_resident_memory_past_its_bound_is_given_back() -> None:
    got = _run(_TRIM)
    assert not got["quiet"] and got["grown"] > got["limit"], got  # under the limit: kept; then really past it
    assert got["trimmed"] and got["trims"] == 1, got
    assert got["after"] < got["grown"] - 400e6, got  # the 600 MB of free pages went back


def test_the_limit_must_be_a_positive_number_of_bytes() -> None:
    from poise.runtime.memory import default_limit_bytes, keep_freed_memory, memory_limit_bytes

    with pytest.raises(ValueError, match="limit_bytes=0 must be a positive number of bytes"):
        keep_freed_memory(limit_bytes=0)
    assert 0 < default_limit_bytes() <= memory_limit_bytes() // 2
