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

`mallopt(M_MMAP_THRESHOLD, 16 MiB)` fixes the threshold (which also stops the adaptation): every
larger tensor gets its own mapping, returned to the system when freed; smaller ones come from the heap.
The price of a mapping is page faults: the kernel maps and zeroes every page of a fresh one, at every
allocation. At 1 MiB (the first setting) nearly every activation paid it: a third of the GRPO update's
and SFT's time went to the system (docs/benchmarks.md, "Two CPU levers under every phase"). At 16 MiB the
activations of a ~2,000-token segment of a small model (a few MiB each) are reused from the heap, and the
large ones (the output layer's logits, the big micro-batches') still go back; measured on an AMD EPYC
with AVX-512 BF16: the update 1.29x faster over 10 steps of random segment lengths for a peak RSS of
6.6 instead of 5.0 GB (the heap's high-water mark, flat once the longest segment was seen), the demo's
SFT steps 1.40x, a decoding turn 1.14x. PyTorch's CPU performance guide suggests preloading jemalloc
or tcmalloc for the same problem; this needs no preload. Left alone when the user set
`MALLOC_MMAP_THRESHOLD_` (glibc's own variable: 1048576 gives the smallest footprint) or when the C
library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES = 16 << 20


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
