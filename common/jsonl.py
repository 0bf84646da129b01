"""Reading JSON-lines files whose bad lines stop with one message naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import MemexError


def read_jsonl(path: str | Path, missing: str, shape: str) -> list[tuple[int, Any]]:
    """[(line number, parsed object)] of the non-blank lines; `missing` and `shape` complete the errors."""
    p = Path(path)
    if not p.is_file():
        raise MemexError(f"{missing}: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MemexError(f"{p} cannot be read as a UTF-8 text file ({exc}); {shape}") from None
    items = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append((n, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise MemexError(f"{p} line {n}: not valid JSON ({exc.msg}); {shape}") from None
    return items
