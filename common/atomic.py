"""Files that appear whole or not at all: written beside their final name, then renamed into place.

A reader (a resumed run, `memexrl demo`'s stage markers, `eval compare`) that finds the file can trust it is
complete; an interrupted writer leaves only a hidden `.NAME.tmp`, which the next write replaces.
"""

from __future__ import annotations

from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (same directory, so the rename never crosses file systems)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
