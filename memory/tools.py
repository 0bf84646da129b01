"""Execution of the memory tools: CompressExperience and ReadExperience (memex.md "The tools").

Every validation error is answered as an observation and changes nothing: the store is
written, and the context rewritten, only when the whole call is valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from memory.anchors import absent_anchors, extract_span, fill_content, line_end_after
from memory.context import ChatRenderer, WorkingContext
from memory.parsing import EXAMPLE_CONTENT, decode_json, quote
from memory.store import BlockWrite, ExperienceStore, is_valid_index

SUMMARY_HEADER = "=== SUMMARY OF YOUR PREVIOUS CONTEXT ==="
TRUNCATION_MARKER = "[TRUNCATED - use ReadExperience(db_index) to retrieve details]"
CARRY_OVER_REMINDER = (
    "[When you compress again, carry every index listed here over into the new summary's index map.]"
)
_ANCHORS = ("start_anchor", "mid_anchor", "end_anchor")


@dataclass(frozen=True)
class ToolOutcome:
    """What a memory tool returns: the observation body and, on error, the error text."""

    observation: str
    error: str | None = None
    compressed: bool = False


def truncate_summary(summary: str, renderer: ChatRenderer, max_tokens: int, mode: str = "tokens") -> str:
    """Cap the summary at `max_tokens` (paper 6.2: 300), counted in real tokens or as 4 chars/token."""
    if mode == "chars":
        limit = 4 * max_tokens
        if len(summary) <= limit:
            return summary
        return summary[:limit].rstrip() + "\n" + TRUNCATION_MARKER
    ids = renderer.encode(summary)
    if len(ids) <= max_tokens:
        return summary
    return renderer.decode(ids[:max_tokens]).rstrip() + "\n" + TRUNCATION_MARKER


def _compress_error(message: str) -> ToolOutcome:
    return ToolOutcome(
        observation=f"CompressExperience error: {message}. Nothing was compressed or stored; fix the call and retry.",
        error=message,
    )


def _blocks_from_arguments(raw: Any, context_text: str | list[str], summary: str) -> list[BlockWrite] | str:
    """Validate db_blocks and resolve anchors; return the blocks to write or an error message."""
    if isinstance(raw, str):  # a JSON string of a list is accepted (memex.md)
        raw, problem = decode_json(raw)
        if problem:
            return f"db_blocks must be a list of blocks (got a string that is not a JSON list: {problem})"
    if not isinstance(raw, list):
        return "db_blocks must be a list of blocks"
    if not raw:
        return "db_blocks is empty; archive at least one block"
    blocks: list[BlockWrite] = []
    seen: set[str] = set()
    for n, block in enumerate(raw, start=1):
        if not isinstance(block, dict):
            return f"block {n} must be an object with db_index and db_content or anchors"
        index = block.get("db_index")
        if index is None or index == "":
            return f"block {n} has no db_index"
        if not is_valid_index(index):
            return f"block {n}: invalid db_index {quote(index)} (use 1-64 characters of A-Z a-z 0-9 _ -)"
        if index in seen:
            return f"db_index {quote(index)} appears twice in this call"
        seen.add(index)
        content = block.get("db_content")
        if content is not None and not isinstance(content, str):
            return f"block {quote(index)}: db_content must be a string"
        if content and not content.strip():  # the release rejects it too: nothing to archive
            return f"block {quote(index)}: db_content is only whitespace; archive the evidence itself"
        if content and content.strip() == EXAMPLE_CONTENT:  # the format hint's placeholder, copied
            return (f"block {quote(index)}: db_content is the format example's placeholder {quote(EXAMPLE_CONTENT)}; "
                    "archive the evidence itself, copied from the context")
        given = [a for a in _ANCHORS if block.get(a) not in (None, "")]
        blank = [a for a in given if isinstance(block[a], str) and not block[a].strip()]
        if blank:  # a whitespace anchor matches any gap and would store a single space (the release rejects it)
            return f"block {quote(index)}: {', '.join(blank)} must not be only whitespace; copy distinctive text from the context"
        if given and len(given) < 3:
            missing = ", ".join(a for a in _ANCHORS if a not in given)
            return f"block {quote(index)}: anchor mode needs all three anchors; missing {missing}"
        if given:
            if not all(isinstance(block[a], str) for a in _ANCHORS):
                return f"block {quote(index)}: anchors must be strings"
            span = extract_span(context_text, *(block[a] for a in _ANCHORS))
            if span is None:
                return _anchor_error(index, context_text, {a: block[a] for a in _ANCHORS})
            blocks.append(BlockWrite(index, fill_content(content, span), "anchor", _describe(index, summary)))
        elif content:
            blocks.append(BlockWrite(index, content, "explicit", _describe(index, summary)))
        else:
            return f"block {quote(index)} has neither db_content nor anchors"
    return blocks


def _anchor_error(index: str, context_text: str | list[str], anchors: dict[str, str]) -> str:
    """Why an anchor block found no span: the anchors that occur nowhere, else that none of the searched texts
    holds start, mid and end in order; and, where start_anchor is followed by mid_anchor, how that line ends
    (an end anchor that would span it)."""
    scoped = not isinstance(context_text, str)  # memory.anchor_scope "observations"
    where = ("any one observation, summary or read-back of the current context (your own messages are not searched)"
             if scoped else "the current context")
    source = "one observation" if scoped else "the context"
    tail = line_end_after(context_text, anchors["start_anchor"], anchors["mid_anchor"])
    hint = f" (where start_anchor is followed by mid_anchor, that line ends with {quote(tail)})" if tail else ""
    absent = absent_anchors(context_text, anchors)
    if absent:
        named = " and ".join(f"{name} {quote(anchors[name])}" for name in absent)
        verb = "occurs" if len(absent) == 1 else "occur"
        return (f"block {quote(index)}: anchors not found in {where}: {named} {verb} nowhere; copy anchors exactly "
                f"from {source}{hint}")
    return (f"block {quote(index)}: anchors not found in {where}: each anchor occurs, but no span from start_anchor "
            f"to end_anchor containing mid_anchor; copy all three from {source}{hint}")


def index_line_key(index: str) -> re.Pattern:
    """The start of an index's own index-map line, `- index:` (not `- index-2:`)."""
    return re.compile(rf"^\s*[-*]?\s*`?{re.escape(index)}`?\s*[:=]\s*")


def _describe(index: str, summary: str) -> str:
    """An index's description: its own index-map line(s) (`- index: what it holds`), else the summary lines
    that name it as a whole word."""
    lines = summary.splitlines()
    key = index_line_key(index)
    own = [line.strip() for line in lines if key.match(line)]
    if own:
        return " ".join(own)[:300]
    named = re.compile(rf"(?<![\w-]){re.escape(index)}(?![\w-])")  # else the lines naming it as a whole word
    return " ".join(line.strip() for line in lines if named.search(line))[:300]


def run_compress(
    arguments: dict,
    context: WorkingContext,
    store: ExperienceStore | None,
    step: int,
    summary_max_tokens: int,
    cap_mode: str = "tokens",
) -> ToolOutcome:
    """CompressExperience{summary, db_blocks}: archive blocks, then context <- [system, task, summary].

    The assistant turn holding this call must already be in `context`; anchors search the
    working context before it. Without a `store` (the compress-only `summary` baseline, the
    release's lossy mode) db_blocks are not needed and nothing is archived.
    """
    summary = arguments.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        return _compress_error("the summary is empty")
    before = context.working_tokens
    n = len(context.segments)
    capped = truncate_summary(summary.strip(), context.renderer, summary_max_tokens, cap_mode)
    if store is None:
        body = f"{SUMMARY_HEADER}\n(compression {n} at step {step}: {before} working tokens compressed)\n{capped}"
        text, _ = context.restart_from_summary(body, [], step)
        return ToolOutcome(observation=text, compressed=True)
    blocks = _blocks_from_arguments(arguments.get("db_blocks"), context.anchor_source(exclude_last=True), summary)
    if isinstance(blocks, str):
        return _compress_error(blocks)
    store.write_many(blocks, step=step)
    stats = (
        f"(compression {n} at step {step}: {before} working tokens compressed; archived "
        f"{', '.join(b.index for b in blocks)}; {len(store)} indices in the experience store)"
    )
    body = f"{SUMMARY_HEADER}\n{stats}\n{capped}\n{CARRY_OVER_REMINDER}"
    text, _ = context.restart_from_summary(body, store.indices(), step)
    return ToolOutcome(observation=text, compressed=True)


def run_read(arguments: dict, store: ExperienceStore, fallback_k: int = 0) -> ToolOutcome:
    """ReadExperience{db_index}: the stored block, or an error listing the available indices.

    With the semantic fallback on (fallback_k > 0) a miss also suggests the closest indices;
    it never returns another block's content.
    """
    index = arguments.get("db_index", "")
    block = store.read(index) if is_valid_index(index) else None
    if block is not None:
        return ToolOutcome(observation=f"Retrieved [{index}] ({len(block.content)} chars):\n{block.content}")
    available = ", ".join(store.indices()) or "none (the experience store is empty)"
    message = f"ReadExperience error: no block with index {quote(index)}. Available indices: {available}"
    if fallback_k > 0 and len(store):
        close = store.suggest(str(index), k=fallback_k)
        if close:
            message += f"\nClosest matches: {', '.join(close)} (call ReadExperience with one of them)"
    return ToolOutcome(observation=message, error=f"no block with index {quote(index)}")
