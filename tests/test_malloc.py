"""common/malloc.py: freed activations go back to the system instead of fragmenting glibc's heap."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.malloc import return_freed_memory

# A fresh process plays what a forward/backward does to the allocator: a large tensor freed (glibc then
# raises its mmap threshold, up to 32 MiB), then activations above the fixed threshold (1.25-2.25x it)
# interleaved with small survivors, three times.
PROGRAM = """
import sys, psutil, torch
from common.malloc import MMAP_THRESHOLD_BYTES, return_freed_memory
if sys.argv[1] == "1":
    assert return_freed_memory()
proc = psutil.Process()
base = proc.memory_info().rss
floats = MMAP_THRESHOLD_BYTES // 16  # a quarter of the threshold, in float32 elements
for step in range(3):
    big = [torch.ones(10 * floats) for _ in range(2)]
    del big
    kept = [(torch.ones((5 + i % 5) * floats), torch.ones(1000)) for i in range(30)]
    kept = [small for _, small in kept]
print((proc.memory_info().rss - base) / 2**20)
"""


def _growth_mib(fixed: bool) -> float:
    done = subprocess.run([sys.executable, "-c", PROGRAM, "1" if fixed else "0"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip().splitlines()[-1])


def test_freed_activations_return_to_the_system():
    if not return_freed_memory():
        pytest.skip("not glibc (or MALLOC_MMAP_THRESHOLD_ set): the allocator is someone else's")
    adaptive, fixed = _growth_mib(False), _growth_mib(True)
    assert adaptive > 100  # the control: glibc's adaptive threshold keeps the freed activations
    assert fixed < 30, f"{fixed:.0f} MiB kept after freeing every activation"


def test_the_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert return_freed_memory() is False
