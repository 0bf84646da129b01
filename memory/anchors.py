"""Anchor-mode extraction for CompressExperience (memex.md "The tools", anchor mode).

The system copies, verbatim, the span of the current working context that starts at
start_anchor, ends at end_anchor (inclusive) and contains mid_anchor. It matches exactly
first, then with whitespace collapsed (runs of whitespace in both the context and the
anchors count as one space); the span returned is always the original text.

The text searched is one string (the working context, memex.md) or a list of strings searched one
after the other, a span never crossing from one to the next (memory.anchor_scope "observations",
memory/context.py WorkingContext.anchor_source).
"""

from __future__ import annotations

import re

_WS = re.compile(r"\s+")


def _find_span(text: str, start: str, mid: str, end: str) -> tuple[int, int] | None:
    """First span [s, e) with text[s:].startswith(start), text[:e].endswith(end), mid inside.

    Starts are tried in order of appearance; for each, the nearest end after it whose span
    contains mid is taken.
    """
    s = text.find(start)
    while s >= 0:
        e = text.find(end, s)
        while e >= 0:
            stop = e + len(end)
            if stop >= s + len(start) and text.find(mid, s, stop) >= 0:
                return s, stop
            e = text.find(end, e + 1)
        s = text.find(start, s + 1)
    return None


def _collapse(text: str) -> tuple[str, list[int]]:
    """Collapse whitespace runs to one space; return the text and, per character, its source index."""
    out: list[str] = []
    source: list[int] = []
    for match in re.finditer(r"\s+|\S+", text):
        if match.group().isspace():
            out.append(" ")
            source.append(match.start())
        else:
            out.append(match.group())
            source.extend(range(match.start(), match.end()))
    return "".join(out), source


def _collapsed_anchor(anchor: str) -> str:
    """An anchor as the whitespace-collapsed match compares it: runs of whitespace as one space, ends stripped."""
    return _WS.sub(" ", anchor).strip()


def extract_span(context: str | list[str], start: str, mid: str, end: str) -> str | None:
    """The verbatim span of `context` bounded by the anchors, or None when not found.

    For a list of texts: the exact match in the first text that has one, else the whitespace-collapsed
    match in the first text that has one."""
    if not (start and mid and end):
        return None
    if not isinstance(context, str):
        tries = ((find, text) for find in (_exact_span, _collapsed_span) for text in context)
        return next((span for find, text in tries if (span := find(text, start, mid, end)) is not None), None)
    return _exact_span(context, start, mid, end) or _collapsed_span(context, start, mid, end)


def _exact_span(context: str, start: str, mid: str, end: str) -> str | None:
    found = _find_span(context, start, mid, end)
    if found is not None:
        return context[found[0] : found[1]]
    return None


def _collapsed_span(context: str, start: str, mid: str, end: str) -> str | None:
    collapsed, source = _collapse(context)
    anchors = [_collapsed_anchor(a) for a in (start, mid, end)]
    if not all(anchors):
        return None
    found = _find_span(collapsed, *anchors)
    if found is None:
        return None
    # Anchors are stripped, so the span starts and ends on non-space characters, which map 1:1.
    return context[source[found[0]] : source[found[1] - 1] + 1]


def absent_anchors(context: str | list[str], anchors: dict[str, str]) -> list[str]:
    """The names of the anchors (name -> text) found in none of the searched texts, exactly or with whitespace
    collapsed: what a rejected anchor block's error names, so the agent knows which anchor to copy again."""
    texts = [context] if isinstance(context, str) else context
    collapsed = [_collapse(text)[0] for text in texts]
    return [name for name, anchor in anchors.items()
            if not any(anchor in text for text in texts)
            and not any(_collapsed_anchor(anchor) in text for text in collapsed)]  # fmt: skip


def line_end_after(context: str | list[str], start: str, mid: str, words: int = 3) -> str | None:
    """In the first searched text where start_anchor is followed by mid_anchor (exactly), the last `words` words of
    mid_anchor's line; None if no text has both. What a rejected anchor block whose start and mid occur is told
    (memory/tools.py): the end anchor is the one the policy guesses (the room overview's last receptacle, ~600
    tokens back: docs/results.md section 4), and the line's end is an end anchor that spans it."""
    for text in [context] if isinstance(context, str) else context:
        s = text.find(start) if start else -1
        m = text.find(mid, s) if s >= 0 and mid else -1
        if m < 0:
            continue
        stop = text.find("\n", m + len(mid))
        tail = text[m : stop if stop >= 0 else len(text)].split()[-words:]
        return " ".join(tail) or None
    return None


def fill_content(db_content: str | None, extracted: str) -> str:
    """Place the extracted span in db_content: at `{{EXTRACT}}` if present, else appended after it."""
    if not db_content:
        return extracted
    if "{{EXTRACT}}" in db_content:
        return db_content.replace("{{EXTRACT}}", extracted)
    return db_content.rstrip("\n") + "\n" + extracted
