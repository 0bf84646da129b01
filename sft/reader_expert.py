"""The reader-expert (issue 27): a scripted engine that plays the reading env (envs/reading.py) well, for SFT.

As the ALFWorld expert (sft/expert.py) follows the game's PDDL plan, this one knows where the task planted its
answer strings (`Trajectory.task["evidence_states"]`, never shown to the policy) and shows the policy what a good controller
does with what it sees:

- reading: `next` until the working context passes warn_ratio * T (the context status's warning), the last
  page has been shown, or the evidence seen since the last compression would make a longer call than
  `EARLY_SHARE` of the turn's token budget; then one CompressExperience that archives, from the pages in the
  working context, the states holding a planted string as one explicit block a trajectory -- each state's
  number and page heading, and the AXTree, thought and action lines with the values -- under an index named
  after the first page (`aurora-cutting-board`), described in the summary's index map by what it holds;
  pages without such a state leave one short `pages-N` block: the trajectories' goals and outcomes and the
  pages visited (CompressExperience archives at least one block). The index map carries every earlier index
  over (memory/tools.py's reminder).
- the question: read the blocks that hold a planted string not read yet, best first, at most the task's
  `max_reads`; then finish.
With `expert.reading_archive: pages` (ours; the default "evidence" is the above) the choice of what to archive no
longer uses the hidden `evidence_states`: each compression archives every page in the working context, whole, as an
anchor-mode block (the paper's section 4.2: exact evidence copied by start/mid/end anchors, a short call however long
the page) under an index named after the site and the page's heading, described by the headings and states it
holds. What a policy sees while paging decides it, so the SFT can imitate it. With `expert.reading_query: catalog`
(ours; the default "evidence" is the above) the question phase no longer uses the hidden planted strings either: it
reads the catalog's first `max_reads` entries in the order the catalog shows them (bm25 of the question first,
memory/catalog.py), then finishes.
The demonstrations are kept when every planted string reached the reader (`success`, rewards/reading.py).
"""

from __future__ import annotations

import re

from common.engine import GenerationRequest
from envs.lme_records import heading_of, page_entry, slug, unique_index
from envs.reading import LAST_PAGE_NOTE
from memory.anchors import extract_span
from memory.catalog import shown_indices, what_it_holds
from memory.context import without_status
from memory.parsing import COMPRESS, EXECUTE_ACTION, FINISH, READ, render_tool_call
from rewards.reading import evidence_found
from rollout.scripted import ScriptedEngine

_STATE_RE = re.compile(r"^State (\d+) \(trajectory (\S+), url ([^)]*)\)$", re.MULTILINE)
_GOAL_RE = re.compile(r"^Trajectory (\d+) of \d+ \(id (\S+)\): goal: (.*)\nStart URL: .*\nOutcome: (.*)$", re.MULTILINE)
PAGES_INDEX = "pages"
MAX_PAGES_CHARS = 400
MAX_BLOCK_LINES = 6
MAX_LINE_CHARS = 120
EARLY_SHARE = 0.6  # compress before the next page once the call would take this share of a turn's tokens
PAGES_EARLY_SHARE = 0.7  # the same for whole-page anchor blocks: ~100 tokens a page (block and index-map line)
ANCHOR_CHARS = 60  # mid anchor: this much of the heading line; start/end: half of it, longer where that recurs


def page_text(observation: str) -> str:
    """A `next` observation (or a state's part of it) without the notes and context status after it."""
    return without_status(observation.split("\n\n" + LAST_PAGE_NOTE)[0]).strip()


def states_in(text: str) -> list[dict]:
    """The states a page shows: {"header", "body"} each (envs/lme_records.py render_state's layout)."""
    marks = list(_STATE_RE.finditer(text))
    out = []
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        body = page_text(text[m.end():end])
        out.append({"header": m.group(0), "trajectory": m.group(2), "state": int(m.group(1)), "body": body})
    return out


def evidence_block(states: list[dict], planted: list, taken: set[str]) -> tuple[str, dict, str] | None:
    """(index, block, what it holds) of the states of one trajectory where the task planted answer strings
    (`evidence_states`: [trajectory, state, string] triples): one block, a few lines a state; None if none."""
    parts, headings, fields = [], [], []
    for state in states:
        needles = [str(n) for tid, k, n in planted if tid == state["trajectory"] and k == state["state"]]
        lines = [ln.strip() for ln in state["body"].splitlines() if ln.strip()]
        hits = [ln[:MAX_LINE_CHARS] for ln in lines if needles and any(evidence_found(ln, needles))]
        if not hits:
            continue
        heading = heading_of(state["body"])
        headings.append(heading or f"state {state['state']}")
        parts.append(f"State {state['state']} ({heading or 'page'}):\n" + "\n".join(hits[:MAX_BLOCK_LINES]))
        fields += [re.sub(r"^\[\w+\]\s*", "", h)[:40] for h in hits[:2]]
    if not parts:
        return None
    index = unique_index(slug(headings[0]), taken)
    content = f"Trajectory {states[0]['trajectory']}\n" + "\n".join(parts)
    pages = ", ".join(dict.fromkeys(headings))
    return index, {"db_index": index, "db_content": content}, f"{pages} ({', '.join(dict.fromkeys(fields[:3]))})"


def edge_anchors(page: str, chars: int, cut: str) -> tuple[str, str]:
    """A page's start and end anchors of about `chars` characters (expert.reading_anchor_cut). "chars": its first and
    last `chars` characters, cut wherever that falls: the end anchor mostly starts inside the previous line's last word
    (`ts'` of `Products'`), which a small policy memorises instead of copying (docs/results.md section 3). "lines":
    the start runs on to the end of the word it cuts; the end is the page's last whole lines, as many as reach
    `chars`; "last_line": the same start, and the page's last line alone (a task's constant `page_end` line, which
    the tool's nearest-end rule makes this page's end)."""
    if cut == "chars":
        return page[:chars].strip(), page[-chars:].strip()
    start = (page[:chars] + re.match(r"\S*", page[chars:]).group(0)).strip()
    lines = page.strip().splitlines()
    if cut == "last_line":
        return start, lines[-1].strip()
    k = next((k for k in range(1, len(lines) + 1) if len("\n".join(lines[-k:]).strip()) >= chars), len(lines))
    return start, "\n".join(lines[-k:]).strip()


def page_block(page: str, source: str | list[str], taken: set[str], cut: str = "chars") -> tuple[str, dict, str] | None:
    """(index, anchor-mode block, what it holds) archiving one whole page (expert.reading_archive "pages"): from its
    first line (a trajectory's goal or a state's header) to its last line, through the first state's heading; None
    when the page shows no state or the anchors would not pick exactly this page out of `source` (what the tool
    searches: WorkingContext.anchor_source). `cut`: where the anchors end (edge_anchors)."""
    shown = states_in(page)
    if not shown:
        return None
    lines = [ln.strip() for ln in page.splitlines() if ln.strip()]
    mid = next((ln for ln in lines if "heading '" in ln), lines[1])[:ANCHOR_CHARS]
    found = None
    for chars in range(ANCHOR_CHARS // 2, 4 * ANCHOR_CHARS + 1, 10):  # the shortest anchors that pick the page out
        start, end = edge_anchors(page, chars, cut)
        if extract_span(source, start, mid, end) == page:
            found = start, end
            break
    if found is None:
        return None
    start, end = found
    headings = list(dict.fromkeys(heading_of(st["body"]) or f"state {st['state']}" for st in shown))
    index, what = page_entry(page, headings, shown[0]["state"], shown[-1]["state"], taken)
    return index, {"db_index": index, "start_anchor": start, "mid_anchor": mid, "end_anchor": end}, what


def _observations(ep) -> list[str]:
    """The working context's messages the agent did not write: the pages, summaries and read-backs."""
    return [m["content"] for m in ep.context.messages[2:] if m["role"] != "assistant"]


class ReaderExpertEngine(ScriptedEngine):
    """The reader-expert as an engine: each request's episode (`req.state`) decides the next turn."""

    def __init__(self, tokenizer, warn_ratio: float = 0.8, archive: str = "evidence", query: str = "evidence",
                 anchor_cut: str = "chars"):
        super().__init__(tokenizer, {})
        self.warn_ratio = warn_ratio
        self._anchor_cut = anchor_cut  # expert.reading_anchor_cut
        self._by_catalog = query == "catalog"  # expert.reading_query
        pages = archive == "pages"  # expert.reading_archive
        self._compress_call = self._compress_pages if pages else self._compress
        self._early_share = PAGES_EARLY_SHARE if pages else EARLY_SHARE

    def generate(self, requests: list[GenerationRequest]):
        for req in requests:
            if req.state is None:
                raise ValueError("ReaderExpertEngine needs the episode in GenerationRequest.state")
            self.scripts.setdefault(req.episode_id, []).append(self.next_turn(req.state, req.max_new_tokens))
        return super().generate(requests)

    def release(self, episode_id: str) -> None:
        super().release(episode_id)
        self.scripts.pop(episode_id, None)

    def next_turn(self, ep, budget: int) -> str:
        task = ep.traj.task
        needles = [str(n) for n in task.get("evidence", [])]
        if task.get("question_step") is not None:
            return self._answer(ep, needles, int(task.get("max_reads", 1)))
        steps = ep.traj.steps
        last = steps[-1].observation if steps else ""
        compressed_last = bool(steps) and steps[-1].compressed
        full = ep.context.working_tokens > self.warn_ratio * ep.context.threshold
        if not compressed_last:
            call = self._compress_call(ep, task.get("evidence_states", []), budget)
            if full or LAST_PAGE_NOTE in last or self._tokens(call) > self._early_share * budget:
                return call
        if LAST_PAGE_NOTE in last or compressed_last and any(LAST_PAGE_NOTE in s.observation for s in steps[-3:]):
            return render_tool_call(EXECUTE_ACTION, {"action": "next"}, "Everything is archived: the question.")
        return render_tool_call(EXECUTE_ACTION, {"action": "next"})

    def _compress(self, ep, planted: list, budget: int) -> str:
        text = "\n\n".join(_observations(ep))
        taken = set(ep.store.indices())
        blocks, lines = [], []
        shown = states_in(text)
        for trajectory in dict.fromkeys(st["trajectory"] for st in shown):
            found = evidence_block([st for st in shown if st["trajectory"] == trajectory], planted, taken)
            if found is not None:
                index, block, what = found
                taken.add(index)
                blocks.append(block)
                lines.append(f"- {index}: {what}")
        if not blocks:  # nothing a question asks about: where the agent went, for the procedure questions
            index, block, what = self._visited_block(ep)
            blocks.append(block)
            lines.append(f"- {index}: {what}")
        pages = [i for i in ep.store.indices() if i.startswith(PAGES_INDEX + "-")]
        earlier = [f"- {i}: {what_it_holds(i, ep.store.read(i).description)}" for i in ep.store.indices()
                   if i not in pages] + ([f"- {', '.join(pages)}: the pages visited earlier"] if pages else [])
        seen = sorted({s["trajectory"] for s in shown})
        summary = (f"Read pages of {', '.join(seen) or 'the trajectories'}; archived what a question may ask.\n"
                   "Index map:\n" + "\n".join(earlier + lines))
        thought = "My working context is filling up: I archive the values I saw."
        return self._fit(COMPRESS, {"summary": summary, "db_blocks": blocks}, thought, budget)

    @staticmethod
    def _visited_block(ep) -> tuple[str, dict, str]:
        """(index, explicit block, what it holds): the goals and the pages visited in the working context."""
        text = "\n\n".join(_observations(ep))
        index = f"{PAGES_INDEX}-{len(ep.context.segments)}"
        visited = " > ".join(dict.fromkeys(heading_of(s["body"]) or "page" for s in states_in(text)))
        goals = [f"Trajectory {m.group(2)}: {m.group(3)} Outcome: {m.group(4)}" for m in _GOAL_RE.finditer(text)]
        content = "\n".join([*goals, f"Pages: {visited}"])[:MAX_PAGES_CHARS]
        return index, {"db_index": index, "db_content": content}, f"the pages visited ({visited[:60]})"

    def _compress_pages(self, ep, planted: list, budget: int) -> str:
        """expert.reading_archive "pages": every page in the working context as its own anchor-mode block; the
        summary's index map describes the new blocks and counts the earlier ones (`planted` is not used)."""
        source = ep.context.anchor_source()
        taken = set(ep.store.indices())
        blocks, lines, seen = [], [], []
        for observation in _observations(ep):
            page = page_text(observation)
            found = page_block(page, source, taken, self._anchor_cut)
            if found is not None:
                index, block, what = found
                taken.add(index)
                blocks.append(block)
                lines.append(f"- {index}: {what}")
                seen.append(states_in(page)[0]["trajectory"])
        if not blocks:  # no page the anchors pick out: where the agent went, as the evidence mode's `pages-N`
            index, block, what = self._visited_block(ep)
            blocks, lines = [block], [f"- {index}: {what}"]
        held = ep.store.indices()  # named by count and range: a list of every name would grow the summary each page
        earlier = [f"- earlier pages: {len(held)} blocks, {held[0]} to {held[-1]}"] if held else []
        summary = (f"Read pages of {', '.join(dict.fromkeys(seen)) or 'the trajectories'}; archived each page whole.\n"
                   "Index map:\n" + "\n".join(earlier + lines))
        thought = "My working context is filling up: I archive the pages I read."
        return self._fit(COMPRESS, {"summary": summary, "db_blocks": blocks}, thought, budget)

    def _tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1

    def _fit(self, name: str, arguments: dict, thought: str, budget: int) -> str:
        """The call with its thought if it fits in `budget` tokens, else without (a cut call is a format error)."""
        for text in (render_tool_call(name, arguments, thought), render_tool_call(name, arguments)):
            if self._tokens(text) <= budget:
                return text
        return text

    def _answer(self, ep, needles: list[str], max_reads: int) -> str:
        asked = ep.traj.task["question_step"]
        read = {str((s.arguments or {}).get("db_index")) for s in ep.traj.steps[asked + 1:]
                if s.tool == READ and s.error is None}
        if self._by_catalog:
            return self._answer_from_catalog(ep, read, max_reads)
        have = "\n".join(ep.store.read(i).content for i in read)
        missing = [n for n, ok in zip(needles, evidence_found(have, needles)) if not ok]
        scored = []
        for index in ep.store.indices():
            if index in read:
                continue
            hits = sum(evidence_found(ep.store.read(index).content, missing))
            if hits:
                scored.append((-hits, index))
        if scored and len(read) < max_reads:
            index = min(scored)[1]
            return render_tool_call(READ, {"db_index": index}, f"Block '{index}' holds what the question asks.")
        return render_tool_call(FINISH, {}, "The blocks I read hold the answer.")

    @staticmethod
    def _answer_from_catalog(ep, read: set[str], max_reads: int) -> str:
        """expert.reading_query "catalog": the next catalog entry not read yet, in the order the question's
        observation shows them (what the policy sees), until `max_reads`; then finish."""
        question = ep.traj.steps[ep.traj.task["question_step"]].observation
        unread = [index for index in shown_indices(question) if index not in read]
        if unread and len(read) < max_reads:
            index = unread[0]
            return render_tool_call(READ, {"db_index": index}, f"Block '{index}' is the catalog's next match.")
        return render_tool_call(FINISH, {}, "The blocks I read hold the answer.")
