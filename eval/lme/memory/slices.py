"""Trajectories as the retrieval modules keep them: stored states, annotated actions, radius slices.

lme-v2.md "Baselines": RAG and AgentRunbook-R index one radius-1 slice per state (states
i-1..i+1, cut at the trajectory's ends); the embedded text is `State k` + the state's AXTree for
each state of the slice, joined by blank lines and capped. Facts taken from the public
`memory_modules/agentrunbook_r.py` / `support.py` (written here anew):

- An action is annotated with the AXTree line of the element it names, looked up in the states
  seen so far: `click('a12')  # [a12] button 'Save'`.
- The data attach an action to the state it leads TO ("transition i = state i -> action stored on
  state i+1 -> state i+1"); `destination_actions` also reads the other convention (an action on
  every state but the last), which some generated data use.
- A retrieved slice is rendered under a section title as: the retrieval facts, the goal, the
  full annotated action sequence, the slice's own action sequence, then each state of the slice
  (`State k (step s)`, URL, action, full AXTree); an image item with the centre state's
  screenshot follows it (here only when the file exists, as the API requires).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import MemexError
from envs.lme_records import state_action, state_text, state_thought

from .base import image_item, text_item

RAW_STATE_SECTION = "## Retrieved Raw State Slices from Previous Tasks in the Environment\n\n"
_AXTREE_LINE = re.compile(r"^\s*\[([A-Za-z0-9_-]+)\]\s*(.+)$")
_ELEMENT_ID = re.compile(r"^[A-Za-z]*\d+[A-Za-z0-9_-]*$")


@dataclass
class Hit:
    """One search result: 1-based rank within its query, cosine score, the entry's payload."""

    rank: int
    score: float
    payload: dict
    query: str = ""

    @property
    def key(self) -> str:
        return str(self.payload["id"])


def truncate_middle(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` by dropping its middle (marked), as the real module caps texts."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    marker = f"\n...[truncated {len(text) - max_chars} chars]...\n"
    if max_chars <= len(marker) + 16:
        return text[:max_chars]
    head = (max_chars - len(marker)) // 2
    tail = max_chars - len(marker) - head
    return text[:head] + marker + text[len(text) - tail:]


def screenshot_path(root: Path | None, shot: str | None) -> str | None:
    """The existing file a state's `screenshot` names (absolute, or under root/ or root/screenshots/)."""
    if not shot:
        return None
    candidates = [Path(shot)] if Path(shot).is_absolute() else []
    if root is not None:
        candidates += [Path(root) / shot, Path(root) / "screenshots" / shot]
    return next((str(p) for p in candidates if p.is_file()), None)


def _element_ids(action: str) -> list[str]:
    """The element ids a BrowserGym call names (first argument; both for drag_and_drop)."""
    try:
        call = ast.parse(action.strip(), mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(call, ast.Call):
        return []
    name = getattr(call.func, "id", getattr(call.func, "attr", ""))
    args = call.args[:2] if name == "drag_and_drop" else call.args[:1]
    return [a.value.strip() for a in args
            if isinstance(a, ast.Constant) and isinstance(a.value, str) and _ELEMENT_ID.match(a.value.strip())]


def element_lines(tree: str) -> dict[str, str]:
    """Element id -> its AXTree line (`[a12] button 'Save'`), first occurrence kept."""
    out: dict[str, str] = {}
    for line in tree.splitlines():
        m = _AXTREE_LINE.match(line)
        if m and m.group(1) not in out:
            out[m.group(1)] = line.strip()
    return out


def destination_actions(states: list[dict]) -> bool:
    """True when actions sit on the state they lead to (the real data: the first state has none)."""
    return not (state_action(states[0]) and not state_action(states[-1])) if states else True


def transitions(states: list[dict]) -> list[tuple[str, str]]:
    """(action, annotated action) of each transition i -> i+1, '' when none was recorded."""
    dest = destination_actions(states)
    known: dict[str, str] = {}
    out = []
    for i in range(len(states) - 1):
        known = {**known, **element_lines(state_text(states[i]))}
        action = state_action(states[i + 1] if dest else states[i])
        details = [known[e] for e in dict.fromkeys(_element_ids(action)) if e in known]
        out.append((action, f"{action}  # {' | '.join(details)}" if details else (action or "<none>")))
    return out


def numbered(lines: list[str], empty: str) -> str:
    """'1. a\\n2. b' (or `empty` when there is nothing)."""
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, start=1)) if lines else f"1. {empty}"


def simplify(trajectory: dict) -> dict:
    """The stored form of a trajectory: its header and, per state, url/action/thought/AXTree/screenshot
    (whichever field names the data use, envs/lme_records.py), plus the annotated transitions."""
    try:
        tid, raw_states = str(trajectory["id"]), list(trajectory["states"])
    except (KeyError, TypeError):
        raise MemexError("a trajectory needs an `id` and a list of `states` (lme-v2.md, trajectories.jsonl); "
                         "check the data set") from None
    states = [{"url": str(s.get("url") or ""), "action": state_action(s), "thought": state_thought(s),
               "text": state_text(s), "screenshot": s.get("screenshot"), "step": s.get("step", i)}
              for i, s in enumerate(raw_states)]
    return {"id": tid, "domain": trajectory.get("domain", ""), "goal": str(trajectory.get("goal") or ""),
            "start_url": str(trajectory.get("start_url") or ""), "outcome": trajectory.get("outcome"),
            "states": states, "annotated": [a for _, a in transitions(states)]}


def slice_bounds(n_states: int, center: int, radius: int) -> tuple[int, int]:
    """[start, end) of the slice around `center`, cut at the trajectory's ends."""
    return max(0, center - radius), min(n_states, center + radius + 1)


def slice_text(traj: dict, start: int, end: int, max_chars: int) -> str:
    """The embedded text of a slice: `State k` + AXTree per state, blank-line separated, capped."""
    blocks = [f"State {k}\n{traj['states'][k]['text']}" for k in range(start, end)]
    return truncate_middle("\n\n".join(blocks).strip(), max_chars)


def slice_entries(traj: dict, radius: int, max_chars: int) -> list[tuple[str, dict]]:
    """(embedded text, payload) of the slice centred on every state of a stored trajectory."""
    out = []
    for center in range(len(traj["states"])):
        start, end = slice_bounds(len(traj["states"]), center, radius)
        out.append((slice_text(traj, start, end, max_chars),
                    {"id": f"{traj['id']}:raw_state:{center:04d}", "tid": traj["id"], "center": center,
                     "start": start, "end": end}))
    return out


def render_state(state: dict, k: int) -> str:
    """One state of a retrieved slice, as the real module shows it."""
    return (f"State {k} (step {state.get('step', k)})\n- URL: {state['url']}\n"
            f"- Action: {state['action'] or '<none>'}\n- AXTree:\n{state['text']}")


def render_slices(trajectories: dict[str, dict], hits: list[Hit], root: Path | None) -> list[dict]:
    """Context items for retrieved slices: the section title, then per slice its text and the centre
    state's screenshot (when the file exists)."""
    if not hits:
        return []
    items = [text_item(RAW_STATE_SECTION)]
    for display_rank, hit in enumerate(hits, start=1):
        p = hit.payload
        traj = trajectories[p["tid"]]
        states = "\n\n".join(render_state(traj["states"][k], k) for k in range(p["start"], p["end"]))
        local = traj["annotated"][p["start"]:max(p["start"], p["end"] - 1)]
        items.append(text_item(
            f"### Raw state result {display_rank}\n- Source raw query: {hit.query}\n"
            f"- Retrieval rank within query: {hit.rank}\n- Similarity: {hit.score:.4f}\n- Trajectory: {p['tid']}\n"
            f"- Goal: {traj['goal']}\n- Center state index: {p['center']}\n\n"
            f"Full action sequence\n{numbered(traj['annotated'], '<no actions recorded>')}\n\n"
            f"Local slice action sequence\n{numbered(local, '<no local actions recorded>')}\n\n"
            f"Relevant state slices\n{states}\n"))
        image = image_item(screenshot_path(root, traj["states"][p["center"]]["screenshot"]))
        if image:
            items.append(image)
    return items
