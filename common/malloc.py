"""Give freed tensor memory back to the operating system (glibc), so that CPU runs keep a flat footprint.

glibc's malloc serves a request below its mmap threshold from the heap and, each time a block
that it had mapped is freed, raises that threshold to the block's size (up to 32 MiB). After the
first few tensors, a transformer's activations (a few to tens of MiB each on a CPU micro-batch)
are therefore carved from the heap; freed in a different order than allocated, they leave holes
that the next forward's differently-shaped tensors do not fit, and the process grows from step
to step. Measured on one GRPO micro-batch of SmolLM2-135M (2 segments x 2,000 tokens, LoRA,
docs/benchmarks.md): peak RSS 17.2 GB with the adaptive threshold, 8.9 GB with it fixed at
1 MiB — and the RSS falls back to ~1 GB after each backward instead of staying at 13 GB. This
is what OOM-killed `make demo`'s second GRPO step on a 24 GB machine.

`mallopt(M_MMAP_THRESHOLD, 1 MiB)` fixes the threshold (which also stops the adaptation): every
larger tensor gets its own mapping, returned to the system when freed. The price is page
faults on fresh mappings: ~6 % more time in `memexrl bench update` (docs/benchmarks.md). PyTorch's CPU
performance guide suggests preloading jemalloc or tcmalloc for the same problem; this needs
no preload. Left alone when the user set `MALLOC_MMAP_THRESHOLD_` (glibc's own variable) or
when the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; True if it was set (False: not glibc, or the user chose)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
