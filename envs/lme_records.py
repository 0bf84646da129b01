"""Reading LME-V2 trajectory records: the field alternatives of the real data (lme-v2.md, "Data layout").

A trajectory is kept as the dict of its `trajectories.jsonl` line (validated by eval/lme/data.py);
these helpers read a state's text, thought and action whichever of the real layout's
alternative field names it uses, so that no module reads the raw keys itself.
"""

from __future__ import annotations

import re

_HEADING_RE = re.compile(r"heading '([^']+)'")
_SITE_RE = re.compile(r"url https?://([a-z0-9-]+)")


def state_text(state: dict) -> str:
    """The AXTree text of a state (`accessibility_tree`, else `text`; '' if neither)."""
    return str(state.get("accessibility_tree") or state.get("text") or "")


def state_thought(state: dict) -> str:
    """The agent's thought at a state (`thought` or `thoughts`, a list joined by spaces)."""
    value = state.get("thought", state.get("thoughts")) or ""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def state_action(state: dict) -> str:
    """The BrowserGym action recorded with a state ('' when none). Layouts differ on whether it is the action
    taken at the state or the one that led to it (eval/lme/memory/slices.py tells them apart)."""
    return str(state.get("action") or "")


def render_state(trajectory: dict, k: int, max_chars: int = 4000) -> str:
    """`State k` of a trajectory as text: url, thought, action, AXTree (capped at `max_chars`)."""
    state = trajectory["states"][k]
    lines = [f"State {k} (trajectory {trajectory['id']}, url {state.get('url', '')})"]
    if state_thought(state):
        lines.append(f"Thought: {state_thought(state)}")
    if state_action(state):
        lines.append(f"Action: {state_action(state)}")
    lines.append(state_text(state)[:max_chars])
    return "\n".join(lines)


def heading_of(text: str) -> str:
    """The first `heading '...'` of a state's AXTree text ('' when it has none): what the page is about."""
    found = _HEADING_RE.search(text)
    return found.group(1) if found else ""


def slug(text: str, limit: int = 40) -> str:
    """An index from a page heading: lower case, words joined by '-'."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))[:limit].strip("-") or "page"


def unique_index(base: str, taken: set[str]) -> str:
    """`base`, else `base-2`, `base-3`, ...: the first that is not in `taken`."""
    index, n = base, 2
    while index in taken:
        index, n = f"{base}-{n}", n + 1
    return index


def page_entry(page: str, headings: list[str], first: int, last: int, taken: set[str]) -> tuple[str, str]:
    """(index, what it holds) of a whole page archived as one block, as the reader-expert's "pages" archive names it
    (sft/reader_expert.py; eval/lme/catalog_recall.py builds the same archive of every page): the index is the site
    and the first heading (`shopnova-home`), what it holds the headings and the states (`Home / Catalog (states 0-1)`).
    `page`: the page's text (render_state's `url` lines name the site); `headings`: one a state, distinct."""
    site = _SITE_RE.search(page)
    index = unique_index(slug(f"{site.group(1) if site else ''} {headings[0]}"), taken)
    states = f"{first}-{last}" if last != first else str(first)
    return index, f"{' / '.join(headings)} (states {states})"
