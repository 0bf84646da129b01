"""argparse types for counts: a bad value is argparse's one-line usage error (exit 2), never a traceback later."""

from __future__ import annotations


def positive_int(text: str) -> int:
    """An int > 0 (argparse reports the ValueError as "invalid positive_int value")."""
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (0 keeps its documented meaning: all, off or in-process)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value
