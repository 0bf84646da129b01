"""Benchmark of the two experience-store backends side by side (memory/store.py).

Writes go one block per ``write_many`` call, i.e. one transaction per block, as the agent's
CompressExperience does; reads are random reads of existing indices, as ReadExperience does
(memex.md, "The tools"). The SQLite store runs with WAL and ``synchronous=FULL``, so its write rate
is bounded by the disk's fsync rate.
"""

from __future__ import annotations

import random
import string
import tempfile
import time
from pathlib import Path

from memory.store import BlockWrite, ExperienceStore, InMemoryStore, SQLiteStore

BACKENDS = ("memory", "sqlite")
METRICS = ("writes_per_s", "reads_per_s")
MIN_READS = 10_000  # dict reads take microseconds: fewer would time mostly noise


def _measure(store: ExperienceStore, contents: list[str], reads: list[int]) -> dict[str, float]:
    start = time.perf_counter()
    for i, content in enumerate(contents):
        store.write_many([BlockWrite(f"block_{i}", content)], step=i)
    write_s = time.perf_counter() - start

    start = time.perf_counter()
    for i in reads:
        if store.read(f"block_{i}") is None:  # a miss would mean the bench measured nothing
            raise RuntimeError(f"block_{i} missing right after it was written")
    read_s = time.perf_counter() - start
    return {"writes_per_s": len(contents) / write_s, "reads_per_s": len(reads) / read_s}


def bench_store(n_blocks: int = 2000, content_chars: int = 400, tmp_dir: str | None = None) -> dict:
    """Writes/s and reads/s of InMemoryStore and SQLiteStore on the same workload.

    Each backend gets ``n_blocks`` writes of ``content_chars`` characters, one block per transaction,
    then ``max(n_blocks, 10000)`` random reads of the written indices.

    Returns ``{"memory": {"writes_per_s", "reads_per_s"}, "sqlite": {...},
    "ratio_sqlite_over_memory": {...}}``; the SQLite file lives in ``tmp_dir`` (a fresh temporary
    directory, removed afterwards, when None).
    """
    if n_blocks < 1 or content_chars < 0:
        raise ValueError("n_blocks must be >= 1 and content_chars >= 0")
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + " "
    contents = ["".join(rng.choices(alphabet, k=content_chars)) for _ in range(n_blocks)]
    reads = [rng.randrange(n_blocks) for _ in range(max(n_blocks, MIN_READS))]

    result: dict[str, dict[str, float]] = {}
    result["memory"] = _measure(InMemoryStore(), contents, reads)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as work:
        with SQLiteStore(Path(work) / "bench_store.db") as store:
            result["sqlite"] = _measure(store, contents, reads)
    result["ratio_sqlite_over_memory"] = {m: result["sqlite"][m] / result["memory"][m] for m in METRICS}
    return result


def format_bench_store(result: dict) -> str:
    """A small aligned table of :func:`bench_store`'s result."""
    rows = [("backend", "writes/s", "reads/s")]
    rows += [
        (name, f"{result[name]['writes_per_s']:,.0f}", f"{result[name]['reads_per_s']:,.0f}")
        for name in BACKENDS
    ]
    ratio = result["ratio_sqlite_over_memory"]
    rows.append(("sqlite/memory", f"{ratio['writes_per_s']:.4f}", f"{ratio['reads_per_s']:.4f}"))
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    return "\n".join(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}" for row in rows)
