"""Reading LME-V2 trajectory records: the field alternatives of the real data (lme-v2.md, "Data layout").

A trajectory is kept as the dict of its `trajectories.jsonl` line (validated by eval/lme/data.py);
these helpers read a state's text, thought and action whichever of the real layout's
alternative field names it uses, so that no module reads the raw keys itself.
"""

from __future__ import annotations


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
