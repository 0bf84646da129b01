"""LLM-written memory entries: JSON replies, and the per-trajectory procedure and hint notes.

lme-v2.md "Baselines": RAG slice+notes and AgentRunbook-R write one procedure note and one hint
note per trajectory with an LLM and retrieve the top 3 of each. From the public
`memory_modules/support.py` and `agentrunbook_r.py` (the facts; prompts written here anew):

- One call per trajectory returns `{"procedure_note": {title, description, content},
  "hint_note": {...}}`, content a string of `- ` bullets; the reply is read as JSON, else the
  ```json fence, else the span from the first `{` to the last `}`; an unreadable reply gets one
  repair call; when that fails too, rule-made fallback notes stand in (procedure: the first 8
  annotated actions; hint: outcome, start URL, action count, first action).
- The run is shown state by state (URL, thought, the next action, and the screenshot). A
  `ChatLLM` here takes text messages, so by default each state's AXTree (capped,
  `options.extra["note_state_chars"]`, default 1500) stands in for its screenshot;
  `options.extra["llm_images"] = True` sends the screenshots as data URLs instead (vision endpoints).
- A note is embedded as `Title: ...\\nDescription: ...\\n<content>`; retrieved notes are rendered
  in one text item under a section title, procedure results first, then hint results.
"""

from __future__ import annotations

import base64
import json
import logging
import mimetypes
import re
from collections.abc import Callable
from pathlib import Path

from eval.lme.llm import ChatLLM

from .base import text_item
from .slices import Hit, screenshot_path, truncate_middle

log = logging.getLogger(__name__)

NOTE_SECTION = "## Procedure and Hint Notes Learned from Previous Tasks in the Environment\n\n"
NOTE_SCHEMA = ('{"procedure_note":{"title":"...","description":"...","content":"- ...\\n- ..."},'
               '"hint_note":{"title":"...","description":"...","content":"- ...\\n- ..."}}')
NOTE_SYSTEM_PROMPT = f"""You turn one recorded run of a UI task into two reusable memory notes for a future
agent. The notes will be retrieved later for questions you cannot know now, about how to do things
in this application and what its pages show.

- procedure_note: how the goal was reached (or, in a failed run, what was attempted): the reliable
  core workflow as 4 to 8 bullets that name the exact pages, menus, tabs, buttons and fields used.
- hint_note: durable facts and pitfalls from the pages the run touched: where things are, defaults,
  required fields, blockers, confusing look-alike controls, signals that confirm success; 6 to 12
  bullets when the run supports that many.
Each note has a short retrieval-friendly title (application, module, task), a one-sentence
description, and content: one string of '- ' bullet lines.
Use only what the run shows; copy UI labels literally; never claim a failed run succeeded; do not
mention state numbers or the word trajectory; distil the agent's thoughts rather than quoting them.
Reply with one JSON object and nothing else: {NOTE_SCHEMA}"""

REPAIR_PROMPT = ("Rewrite the draft below as one valid JSON object of exactly this shape, keeping its "
                 "content: {schema}\nReply with the JSON object only: no commentary, no markdown fences.")


def json_candidates(text: str) -> list[str]:
    """The reply, its ```json fenced block, and its first-{-to-last-} span: the strings to try as JSON."""
    stripped = text.strip()
    out = [stripped] if stripped else []
    fence = re.search(r"```(?:json)?\s*(\{.*\})\s*```", stripped, flags=re.S)
    if fence:
        out.append(fence.group(1).strip())
    first, last = stripped.find("{"), stripped.rfind("}")
    if 0 <= first < last:
        out.append(stripped[first:last + 1])
    return list(dict.fromkeys(out))


def parse_json_object(text: str, read: Callable[[dict], object]) -> object:
    """`read(obj)` of the first candidate that parses to an object `read` accepts (it raises
    ValueError/TypeError/KeyError otherwise); ValueError when none does."""
    errors = []
    for candidate in json_candidates(text):
        try:
            obj = json.loads(candidate)
            if not isinstance(obj, dict):
                raise TypeError("not a JSON object")
            return read(obj)
        except (ValueError, TypeError, KeyError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    raise ValueError(f"no usable JSON object in the reply ({'; '.join(errors[-2:]) or 'empty reply'})")


def ask_json(llm: ChatLLM, messages: list[dict], read: Callable[[dict], object], schema: str, what: str):
    """Ask `llm`, read its reply with `read`; on failure one repair call; None (logged) if that fails too."""
    reply = llm.complete(messages)
    try:
        return parse_json_object(reply, read)
    except ValueError as exc:
        first_error = exc
    if reply.strip():
        repaired = llm.complete([{"role": "system", "content": REPAIR_PROMPT.format(schema=schema)},
                                 {"role": "user", "content": reply}])
        try:
            return parse_json_object(repaired, read)
        except ValueError:
            pass
    log.warning("%s: the LLM's reply could not be read as JSON (%s); using the fallback", what, first_error)
    return None


def data_url(path: str) -> str:
    mime = mimetypes.guess_type(path)[0] or "image/png"
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode('ascii')}"


def user_message(parts: list[tuple[str, str | None]], images: bool) -> dict:
    """A user message from (text, screenshot path) parts: plain text, or text and image_url parts."""
    if not images:
        return {"role": "user", "content": "\n\n".join(text for text, _ in parts)}
    content: list[dict] = []
    for text, shot in parts:
        content.append({"type": "text", "text": text})
        if shot:
            content.append({"type": "image_url", "image_url": {"url": data_url(shot)}})
    return {"role": "user", "content": content}


def outcome_text(traj: dict) -> str:
    value = traj.get("outcome")
    return str(value).strip() if value is not None and str(value).strip() else "<unknown>"


def note_messages(traj: dict, root: Path | None, images: bool, state_chars: int) -> list[dict]:
    """The note-writing prompt for one stored trajectory (slices.simplify form)."""
    header = "\n".join([
        "Write the two notes for this run.", f"Goal: {traj['goal']}", f"Outcome: {outcome_text(traj)}",
        f"Start URL: {traj['start_url']}",
        "Each state shows its URL, the agent's thought and the action taken from it to the next state, then "
        + ("its screenshot." if images else "the start of its accessibility tree."),
        f"Reply with the JSON object only: {NOTE_SCHEMA}"])
    parts: list[tuple[str, str | None]] = [(header, None)]
    for k, state in enumerate(traj["states"]):
        action = traj["annotated"][k] if k < len(traj["annotated"]) else "<end of run>"
        text = f"State {k}\nURL: {state['url']}\nThought: {state['thought'] or '<none>'}\nNext action: {action}"
        shot = screenshot_path(root, state["screenshot"]) if images else None
        if not images and state_chars > 0:
            text += f"\nAccessibility tree:\n{truncate_middle(state['text'], state_chars)}"
        parts.append((text, shot))
    return [{"role": "system", "content": NOTE_SYSTEM_PROMPT}, user_message(parts, images)]


def _note(raw: object) -> dict:
    if not isinstance(raw, dict):
        raise TypeError("a note must be an object")
    title, description, content = (raw.get(k) for k in ("title", "description", "content"))
    if isinstance(content, list):
        content = "\n".join(line if str(line).startswith("- ") else f"- {line}" for line in content if str(line).strip())
    if not all(isinstance(v, str) and v.strip() for v in (title, description, content)):
        raise ValueError("a note needs non-empty title, description and content")
    return {"title": title.strip(), "description": description.strip(), "content": content.strip()}


def read_notes(obj: dict) -> tuple[dict, dict]:
    """(procedure note, hint note) of a parsed reply."""
    return _note(obj.get("procedure_note")), _note(obj.get("hint_note"))


def fallback_notes(traj: dict) -> tuple[dict, dict]:
    """Rule-made notes for when no LLM is given or its reply is unreadable (as the real module's)."""
    actions = traj["annotated"] or ["<no recorded actions>"]
    procedure = {"title": f"Procedure fallback for {traj['goal'][:60]}",
                 "description": "Fallback procedure note built without an LLM-written note.",
                 "content": "\n".join(f"- Step {i}: {a}" for i, a in enumerate(actions[:8], start=1))}
    hint = {"title": f"Hint fallback for {traj['goal'][:60]}",
            "description": "Fallback hint note built without an LLM-written note.",
            "content": f"- Outcome: {outcome_text(traj)}\n- Start URL: {traj['start_url']}\n"
                       f"- Recorded actions: {len(traj['annotated'])}\n- First observed action: {actions[0]}"}
    return procedure, hint


def write_notes(llm: ChatLLM | None, traj: dict, root: Path | None, extra: dict) -> tuple[dict, dict]:
    """The (procedure, hint) notes of one trajectory: one LLM call (+ one repair), else the fallbacks."""
    if llm is not None:
        messages = note_messages(traj, root, bool(extra.get("llm_images", False)),
                                 int(extra.get("note_state_chars", 1500)))
        notes = ask_json(llm, messages, read_notes, NOTE_SCHEMA, f"notes of trajectory {traj['id']}")
        if notes is not None:
            return notes
    return fallback_notes(traj)


def note_entry(traj: dict, kind: str, note: dict) -> tuple[str, dict]:
    """(embedded text, payload) of a note."""
    payload = {"id": f"{traj['id']}:{kind}_note", "tid": traj["id"], **note}
    return f"Title: {note['title']}\nDescription: {note['description']}\n{note['content']}", payload


def render_notes(note_query: str, procedures: list[Hit], hints: list[Hit]) -> list[dict]:
    """One text item with the retrieved notes (none when there is no query or no hit)."""
    if not note_query or not (procedures or hints):
        return []
    parts = [NOTE_SECTION, f"- Note query: {note_query}\n\n"]
    for heading, hits in (("### Procedure note results\n", procedures), ("### Hint note results\n", hints)):
        if hits:
            parts.append(heading)
        for hit in hits:
            p = hit.payload
            parts.append(f"- Rank {hit.rank} | score={hit.score:.4f} | trajectory={p['tid']}\n  Title: {p['title']}\n"
                         f"  Description: {p['description']}\n{p['content']}\n\n")
    return [text_item("".join(parts).strip() + "\n")]

