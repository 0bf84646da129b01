"""`agentrunbook_r`: the paper's AgentRunbook-R, four retrieval pools behind a query-writing controller.

lme-v2.md "Baselines": four pools (raw-state slices, state-transition events written by an LLM
from pre/post states, procedure notes, hint notes); a controller LLM turns the question into
`{raw_state_queries (<=5), event_query, note_query}`; top-6 slices per query merged to a budget
of 6 (per-query cap 2), top-6 events, top-3 notes per type; rendered notes, then events, then
slices. Facts from the public `agentrunbook_r.py` (its configs: rerank off), written here anew:

- The controller's reply is read as JSON (else its fence, else its first-{-to-last-} span); it
  gets one repair call when unreadable. `raw_state_queries` must be a list (whitespace-normalised,
  deduplicated, capped at 5); a missing `event_query`/`note_query` is "". When both tries fail,
  the question itself is used for every pool (logged). An empty query skips its pool.
- Merging (`merge_slice_hits`): with n <= 3 raw-state queries each query keeps up to
  max(1, budget // n) new slices, with 4-5 queries each keeps up to the per-query cap (2), in
  query order, skipping slices already taken. The real module does not trim the 4-5 query case to
  the budget (up to 8 or 10 slices); this follows it.
- One event per transition (state i -> its action -> state i+1): one LLM call shown the goal,
  outcome, full annotated action trace, and the pre- and post-state (URL, thought, incoming
  action, AXTree; the real module adds both screenshots, here `options.extra["llm_images"]`);
  the reply `{"overview", "state_transition"}` becomes `overview\\n\\nstate_transition`, which is
  embedded; unreadable replies get a rule-made event (goal recap, action, URL change, thoughts).
- An event is rendered with its transition and description, then its pre- and post-state
  screenshots as image items (here only those that exist).

Cost: insert makes one LLM call per transition (about states - 1 per trajectory: ~2.4K calls for a
small haystack, ~14.4K for a medium one, each + one repair call when unreadable) plus one notes call
per trajectory. `options.extra["max_events_per_trajectory"]` (default 64, above the ~25-state mean)
bounds the LLM calls per trajectory; later transitions, and all of them without an LLM, get
rule-made events. `options.extra["event_state_chars"]` (default 12000, the real module's
fallback cap) caps each AXTree in the event prompt. A query makes one controller call (+ repair).
"""

from __future__ import annotations

import functools
import logging
import re

from .base import image_item, register, text_item
from .index import PooledMemory
from .notes import (
    ask_json,
    note_entry,
    outcome_text,
    parse_json_object,
    render_notes,
    user_message,
    write_notes,
)
from .slices import Hit, render_slices, screenshot_path, slice_entries, truncate_middle

log = logging.getLogger(__name__)

EVENT_SECTION = "## Retrieved State-Transition Events from Previous Tasks in the Environment\n\n"
BUNDLE_SCHEMA = '{"raw_state_queries":["..."],"event_query":"...","note_query":"..."}'
CONTROLLER_PROMPT = f"""You write retrieval queries for a memory of past UI task runs with three pools:
raw state slices (exact page content: pages, forms, records, tabs, fields, buttons, options, labels,
default values, counts), state-transition events (what changed after an action: navigation,
revealed panels, confirmations, blockers), and procedure/hint notes (reusable workflows, module
paths, pitfalls, missing features).
Do not answer the question; write the queries that retrieve the evidence to answer it.
- raw_state_queries: up to 5 short queries, one per distinct page or surface the answer needs;
  merge aspects of the same page into one query. Empty only for purely procedural questions.
- event_query: the transition or state change to look for, or "" if the question is about a
  static page.
- note_query: a task-family-level query about the workflow or pitfalls, or "".
Keep exact entity names and UI labels from the question; drop answer formats and multiple-choice
letters; no filler words.
Reply with one JSON object and nothing else: {BUNDLE_SCHEMA}"""
EVENT_SCHEMA = '{"overview":"...","state_transition":"..."}'
EVENT_PROMPT = f"""You describe one step of a recorded UI task run as retrieval-ready text.
- overview: one short paragraph: the concrete goal and what stage of the workflow this step is.
- state_transition: one short paragraph comparing the post-state with the pre-state: what the
  action caused (new page or panel, fields, changed values, confirmation, blocker, popup, or no
  visible change).
Use only the evidence given; reuse exact labels, names, values and counts; do not invent controls
or outcomes; do not quote thoughts verbatim.
Reply with one JSON object and nothing else: {EVENT_SCHEMA}"""


def _norm(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError("queries must be strings")
    return re.sub(r"\s+", " ", text).strip()


def read_bundle(obj: dict, max_queries: int = 5) -> dict:
    """The query bundle of a parsed controller reply (KeyError/TypeError when it is not one)."""
    raw = obj["raw_state_queries"]
    if not isinstance(raw, list):
        raise TypeError("raw_state_queries is not a list")
    queries = list(dict.fromkeys(q for q in (_norm(x) for x in raw if isinstance(x, str)) if q))
    return {"raw_state_queries": queries[:max_queries], "event_query": _norm(obj.get("event_query", "")),
            "note_query": _norm(obj.get("note_query", ""))}


def parse_query_bundle(reply: str, max_queries: int = 5) -> dict:
    """The controller's `{raw_state_queries, event_query, note_query}`; ValueError when unreadable."""
    return parse_json_object(reply, functools.partial(read_bundle, max_queries=max_queries))


def fallback_bundle(question: str) -> dict:
    """The question itself for every pool."""
    q = _norm(question)
    return {"raw_state_queries": [q] if q else [], "event_query": q, "note_query": q}


def merge_slice_hits(blocks: list[list[Hit]], budget: int = 6, per_query_cap: int = 2) -> list[Hit]:
    """Merge per-query ranked slice lists: n <= 3 queries keep max(1, budget // n) new slices each,
    more queries keep `per_query_cap` each (not trimmed to the budget, as in the real module)."""
    if not blocks:
        return []
    limit = max(1, budget // len(blocks)) if len(blocks) <= 3 else per_query_cap
    merged: list[Hit] = []
    seen: set[str] = set()
    for hits in blocks:
        taken = 0
        for hit in hits:
            if taken >= limit:
                break
            if hit.key not in seen:
                seen.add(hit.key)
                merged.append(hit)
                taken += 1
    return merged


def _read_event(obj: dict) -> dict:
    fields = {k: obj.get(k) for k in ("overview", "state_transition")}
    if not all(isinstance(v, str) and v.strip() for v in fields.values()):
        raise ValueError("overview and state_transition must be non-empty strings")
    return {k: v.strip() for k, v in fields.items()}


def event_messages(traj: dict, i: int, root, images: bool, state_chars: int) -> list[dict]:
    """The prompt for transition i (state i -> state i+1) of a stored trajectory."""
    n = len(traj["states"]) - 1
    action = traj["annotated"][i]
    header = "\n".join([
        f"Describe transition {i + 1} of {n} only.", f"Goal: {traj['goal']}", f"Outcome: {outcome_text(traj)}",
        f"Start URL: {traj['start_url']}", f"Target transition: state {i} -> {action} -> state {i + 1}",
        "Full annotated action trace:", "\n".join(f"{k}. {a}" for k, a in enumerate(traj["annotated"], 1)),
        f"Reply with the JSON object only: {EVENT_SCHEMA}"])
    parts: list[tuple[str, str | None]] = [(header, None)]
    for label, k, incoming in (("Pre-state", i, traj["annotated"][i - 1] if i else "<initial state>"),
                               ("Post-state", i + 1, action)):
        s = traj["states"][k]
        parts.append((f"{label} {k}\nURL: {s['url']}\nThought: {s['thought'] or '<none>'}\n"
                      f"Action that led here: {incoming}\nAccessibility tree:\n{truncate_middle(s['text'], state_chars)}",
                      screenshot_path(root, s["screenshot"]) if images else None))
    return [{"role": "system", "content": EVENT_PROMPT}, user_message(parts, images)]


def fallback_event(traj: dict, i: int) -> dict:
    pre, post, n = traj["states"][i], traj["states"][i + 1], len(traj["states"]) - 1
    return {"overview": f"Goal recap: {traj['goal']} This transition is step {i + 1} of {n} in the workflow.",
            "state_transition": f"After action {traj['annotated'][i]}, the interface moved from {pre['url']} to "
                                f"{post['url']}. Visible state evidence was limited to the stored pre/post thoughts: "
                                f"pre={pre['thought'] or '<none>'} post={post['thought'] or '<none>'}."}


def render_events(event_query: str, hits: list[Hit], trajectories: dict[str, dict], root) -> list[dict]:
    if not event_query or not hits:
        return []
    items = [text_item(EVENT_SECTION + f"- Event query: {event_query}\n\n")]
    for display_rank, hit in enumerate(hits, start=1):
        p = hit.payload
        states = trajectories[p["tid"]]["states"]
        images = [image_item(screenshot_path(root, states[k]["screenshot"])) for k in (p["pre"], p["post"])]
        notes = [f"- The next image is the {name}-state screenshot.\n"
                 for name, img in zip(("pre", "post"), images) if img]
        items.append(text_item(
            f"### Event result {display_rank}\n- Retrieval rank: {hit.rank}\n- Similarity: {hit.score:.4f}\n"
            f"- Trajectory: {p['tid']}\n- Transition: state {p['pre']} -> {p['action']} -> state {p['post']}\n\n"
            f"Description\n{p['description']}\n" + ("\nImages\n" + "".join(notes) if notes else "")))
        items += [img for img in images if img]
    return items


@register
class AgentRunbookR(PooledMemory):
    """Slices, events and notes, retrieved with the controller's query bundle (lme-v2.md "AgentRunbook-R")."""

    name = "agentrunbook_r"
    pool_names = ("slices", "events", "procedures", "hints")

    def build_signature(self) -> dict:
        x = self.options.extra
        return {**super().build_signature(), "max_events_per_trajectory": int(x.get("max_events_per_trajectory", 64))}

    def insert(self, trajectory: dict) -> None:
        traj = self.add_trajectory(trajectory)
        o, x = self.options, self.options.extra
        for text, payload in slice_entries(traj, o.slice_radius, o.slice_text_chars):
            self.pools["slices"].add(text, payload)
        budget = int(x.get("max_events_per_trajectory", 64)) if o.llm is not None else 0
        for i in range(len(traj["states"]) - 1):
            fields = None
            if i < budget:
                messages = event_messages(traj, i, o.root, bool(x.get("llm_images", False)),
                                          int(x.get("event_state_chars", 12000)))
                fields = ask_json(o.llm, messages, _read_event, EVENT_SCHEMA, f"event {i} of {traj['id']}")
            fields = fields or fallback_event(traj, i)
            description = f"{fields['overview']}\n\n{fields['state_transition']}"
            self.pools["events"].add(description, {"id": f"{traj['id']}:event_{i:04d}_{i + 1:04d}", "tid": traj["id"],
                                                   "pre": i, "post": i + 1, "action": traj["annotated"][i],
                                                   "description": description})
        procedure, hint = write_notes(o.llm, traj, o.root, x)
        self.pools["procedures"].add(*note_entry(traj, "procedure", procedure))
        self.pools["hints"].add(*note_entry(traj, "hint", hint))

    def memory_summary(self) -> str:
        """Pool sizes and a spread of stored goals, shown to the controller."""
        goals = [self.trajectories[t]["goal"][:100] for t in self.ids]
        step = max(1, len(goals) // 6)
        lines = [f"Memory of {len(self.ids)} past runs: {len(self.pools['slices'])} raw state slices, "
                 f"{len(self.pools['events'])} events, {len(self.pools['procedures'])} procedure notes, "
                 f"{len(self.pools['hints'])} hint notes.", "Some goals in memory:"]
        return "\n".join(lines + [f"- {g}" for g in goals[::step][:6]])

    def query_bundle(self, question: str, question_image: str | None = None) -> dict:
        """The controller's queries for the question (the question itself when there is no controller
        or its reply cannot be read)."""
        controller = self.options.controller
        if controller is not None:
            user = (f"{self.memory_summary()}\n\nQuestion: {question}\nQuestion image: {question_image or '<none>'}\n\n"
                    f"Reply with the JSON object only: {BUNDLE_SCHEMA}")
            messages = [{"role": "system", "content": CONTROLLER_PROMPT}, {"role": "user", "content": user}]
            read = functools.partial(read_bundle, max_queries=self.options.max_raw_queries)
            bundle = ask_json(controller, messages, read, BUNDLE_SCHEMA, "agentrunbook_r controller")
            if bundle is not None:
                return bundle
        else:
            log.warning("agentrunbook_r has no controller LLM: the question is the query for every pool")
        return fallback_bundle(question)

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        self.flush()
        o = self.options
        bundle = self.query_bundle(question, question_image)
        raw, event_q, note_q = bundle["raw_state_queries"], bundle["event_query"], bundle["note_query"]
        vectors = self.embed_queries([*raw, event_q, note_q])
        blocks = [self.pools["slices"].search(vectors[q], o.slice_top_k, q) for q in raw if q in vectors]
        slices = merge_slice_hits(blocks, o.merge_budget, o.merge_per_query_cap)
        events = self.pools["events"].search(vectors[event_q], o.event_top_k, event_q) if event_q in vectors else []
        procedures = hints = []
        if note_q in vectors:
            procedures = self.pools["procedures"].search(vectors[note_q], o.note_top_k, note_q)
            hints = self.pools["hints"].search(vectors[note_q], o.note_top_k, note_q)
        return (render_notes(note_q, procedures, hints) + render_events(event_q, events, self.trajectories, o.root)
                + render_slices(self.trajectories, slices, o.root))
