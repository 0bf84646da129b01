"""Files and directories that appear whole or not at all, and survive a power cut once they have appeared.

A reader (a resumed run, `memexrl demo`'s stage markers, `eval compare`) that finds the file can
trust that it is complete. An interrupted writer leaves only a hidden `.NAME.tmp`, which the next
write replaces. Like SQLite, the data is fsync'ed before the rename that publishes it, and the
directory after it. Without the first fsync, a crash right after the rename can leave a complete
name pointing at empty blocks (ext4 `data=writeback`, XFS); without the second, the rename itself
can be lost.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` (creations, renames) durable. A no-op where directories cannot
    be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under `root`, then every directory bottom-up (their entries)."""
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(dirpath)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (same directory, so the rename never crosses file systems)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)
    return path
