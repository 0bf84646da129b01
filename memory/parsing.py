"""Model output -> one tool call: a pure function, as verl-agent parses text to actions.

Contract (design.md "Model output format"): one Qwen-style call per assistant turn,
optionally after free text or thinking:
    <tool_call>{"name": NAME, "arguments": {...}}</tool_call>
A malformed call (unclosed tag, JSON that does not parse, missing name, unknown tool,
missing or ill-typed required argument, two calls) is a *format error* (memex.md, P_format):
the observation says exactly what was wrong. A reply with no call at all is not a format
error; the agent is asked for one.

The policy's text is untrusted: whatever it writes, parsing returns a `ParsedCall` and never
raises. JSON that is too deep for the decoder, nested deeper than `MAX_ARGUMENT_DEPTH`, holding a
lone surrogate (`\\ud800`: not Unicode, so no tokenizer, file or database can take it) or a number
past Python's integer-digit limit is a format error; values the agent wrote are quoted back at
most `QUOTE_CHARS` characters long (`quote`), so an error observation stays small.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_ARGUMENT_DEPTH = 8  # lists / objects inside the call; the tools need 3 (call -> db_blocks -> block)
QUOTE_CHARS = 60  # at most this much of an agent-written value is repeated in an error observation

EXECUTE_ACTION = "execute_action"
COMPRESS = "CompressExperience"
READ = "ReadExperience"
FINISH = "finish"
MEMORY_TOOLS = (COMPRESS, READ)

# name -> {argument: (required, accepted python types)}; the JSON schemas below say the same for the prompt.
_ARGUMENTS: dict[str, dict[str, tuple[bool, tuple[type, ...]]]] = {
    EXECUTE_ACTION: {"action": (True, (str,))},
    COMPRESS: {"summary": (True, (str,)), "db_blocks": (True, (list, str))},
    READ: {"db_index": (True, (str,))},
    FINISH: {"success": (False, (bool,))},
}

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": EXECUTE_ACTION,
            "description": "Run one ALFWorld command (for example 'take apple 2 from fridge 1'). "
            "Object and receptacle names must be exact, as they appeared in observations.",
            "parameters": {
                "type": "object",
                "properties": {"action": {"type": "string", "description": "The command."}},
                "required": ["action"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": COMPRESS,
            "description": "Replace your working context with an indexed summary and archive exact evidence "
            "in the experience store under stable indices. Each block is either explicit "
            "{db_index, db_content} or anchored {db_index, start_anchor, mid_anchor, end_anchor}: the system "
            "copies verbatim the span of your current context from start_anchor to end_anchor that contains "
            "mid_anchor (an optional db_content with {{EXTRACT}} marks where the span goes).",
            "parameters": {
                "type": "object",
                "properties": {
                    "summary": {
                        "type": "string",
                        "description": "Progress so far and an index map: one line per index saying what it holds.",
                    },
                    "db_blocks": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "db_index": {"type": "string", "description": "1-64 chars of [A-Za-z0-9_-]."},
                                "db_content": {"type": "string"},
                                "start_anchor": {"type": "string"},
                                "mid_anchor": {"type": "string"},
                                "end_anchor": {"type": "string"},
                            },
                            "required": ["db_index"],
                        },
                    },
                },
                "required": ["summary", "db_blocks"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": READ,
            "description": "Bring an archived block back into your context by its index.",
            "parameters": {
                "type": "object",
                "properties": {"db_index": {"type": "string"}},
                "required": ["db_index"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": FINISH,
            "description": "End the episode (the task is done or cannot be done).",
            "parameters": {"type": "object", "properties": {"success": {"type": "boolean"}}, "required": []},
        },
    },
]

CALL_EXAMPLE = '<tool_call>{"name": "execute_action", "arguments": {"action": "look"}}</tool_call>'
# A format error shows the form of the tool the broken call names (else CALL_EXAMPLE): a cut or invalid
# CompressExperience call is answered with a CompressExperience call's shape, not with `look`.
# The placeholder content of the CompressExperience example: a call that archives it verbatim is a tool error
# (memory/tools.py), not an accepted compression of nothing (a weak policy copied the hint after a format error).
EXAMPLE_CONTENT = "exact text"
CALL_EXAMPLES = {
    EXECUTE_ACTION: CALL_EXAMPLE,
    COMPRESS: ('<tool_call>{"name": "CompressExperience", "arguments": {"summary": "Progress ... Index map:\\n'
               '- facts: what it holds", "db_blocks": [{"db_index": "facts", "db_content": "' + EXAMPLE_CONTENT
               + '"}]}}</tool_call>'),
    READ: '<tool_call>{"name": "ReadExperience", "arguments": {"db_index": "facts"}}</tool_call>',
    FINISH: '<tool_call>{"name": "finish", "arguments": {"success": true}}</tool_call>',
}
_NAMED = re.compile(r'"name"\s*:\s*"([A-Za-z_]+)"')
NO_CALL_MESSAGE = (
    "No tool call found. Reply with exactly one tool call, for example: " + CALL_EXAMPLE
)


@dataclass(frozen=True)
class ParsedCall:
    """The outcome of parsing one assistant reply.

    kind: "call" (a well-formed call), "none" (no call attempted) or "malformed".
    """

    kind: str
    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None

    @property
    def format_error(self) -> bool:
        return self.kind == "malformed"


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """`value` as the agent wrote it, for an error observation: its repr, cut to `limit` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def untrusted_problem(value: Any) -> str | None:
    """Why a decoded JSON value cannot be kept (None: it can): too deep, or a string that is not Unicode."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return "a string holds a lone surrogate such as \\ud800, which is not valid Unicode"
        elif isinstance(item, (dict, list)):
            if depth >= MAX_ARGUMENT_DEPTH:
                return f"the call is nested more than {MAX_ARGUMENT_DEPTH} levels deep"
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def decode_json(text: str) -> tuple[Any, str | None]:
    """json.loads for untrusted text: (value, None), or (None, why it cannot be used). Never raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg})"
    except RecursionError:
        return None, "not valid JSON (too deeply nested)"
    except ValueError as exc:  # e.g. an integer past sys.get_int_max_str_digits
        return None, f"not valid JSON ({str(exc).split(';')[0]})"
    problem = untrusted_problem(value)
    return (None, problem) if problem else (value, None)


def _malformed(message: str, call_text: str = "", example: str = "") -> ParsedCall:
    """A format error, with `example` or else the form of the tool that `call_text` (the broken call) names, if any."""
    if not example:
        named = _NAMED.search(call_text)
        example = CALL_EXAMPLES.get(named.group(1), CALL_EXAMPLE) if named else CALL_EXAMPLE
    return ParsedCall(kind="malformed", error=f"Format error: {message}. Use exactly: {example}")


def answer_part(text: str, thinking: bool = False) -> str:
    """The part of a reply that can hold the tool call: without <think>...</think> blocks; with
    `thinking` (a chat template that opens <think> in the prompt, as Qwen3 thinking models' do, so the
    reply is reasoning, </think>, answer) only the text after the last </think> ('' while it still thinks)."""
    if thinking:
        head, sep, tail = text.rpartition(THINK_CLOSE)
        return tail if sep else ""
    return _THINK_RE.sub("", text)


def parse_tool_call(text: str, tools: tuple[str, ...] | None = None, optional: tuple[str, ...] = (),
                    thinking: bool = False, archive: Container[str] = ()) -> ParsedCall:
    """Parse one assistant reply into a tool call.

    `tools` restricts the accepted tool names (e.g. baselines without memory tools);
    None accepts all four. `optional` names arguments that are not required here (the
    compress-only baseline's CompressExperience has no db_blocks). Reasoning is ignored:
    <think>...</think> blocks, or with `thinking` everything up to the last </think>
    (`answer_part`), so a <tool_call> the model mentions while reasoning is not a call.
    `archive` holds the experience store's indices (the store itself will do): a call named after one of
    them (a weak policy's way to read a block) is answered with the ReadExperience call that reads it.
    """
    allowed = tuple(_ARGUMENTS) if tools is None else tools
    visible = answer_part(text, thinking)
    n_open = visible.count(OPEN_TAG)
    n_close = visible.count(CLOSE_TAG)
    if n_open == 0:
        if n_close:
            return _malformed(f"found {CLOSE_TAG} without an opening {OPEN_TAG}")
        return ParsedCall(kind="none")
    if n_open > 1:
        return _malformed(f"found {n_open} tool calls; make exactly one call per turn")
    start = visible.index(OPEN_TAG) + len(OPEN_TAG)
    end = visible.find(CLOSE_TAG, start)
    if end < 0:
        return _malformed(f"unclosed {OPEN_TAG} tag (add {CLOSE_TAG})", visible[start:])
    body = visible[start:end].strip()
    call, problem = decode_json(body)
    if problem:
        return _malformed(f"the call is {problem}" if problem.startswith("not valid") else problem, body)
    if not isinstance(call, dict):
        return _malformed("the call must be a JSON object with 'name' and 'arguments'")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return _malformed("the call has no 'name'")
    if name not in allowed:
        if name in archive and READ in allowed:
            return _malformed(f"{quote(name)} is an archive index, not a tool; read it back with ReadExperience",
                              example=render_tool_call(READ, {"db_index": name}))
        return _malformed(f"unknown tool {quote(name)}; available tools: {', '.join(allowed)}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models emit arguments as a JSON string
        arguments, problem = decode_json(arguments)
        if problem:
            return _malformed(f"the arguments of {name} are not a JSON object: {problem}", body)
    if not isinstance(arguments, dict):
        return _malformed(f"the arguments of {name} must be a JSON object", body)
    for arg, (required, types) in _ARGUMENTS[name].items():
        if arg not in arguments:
            if required and arg not in optional:
                return _malformed(f"{name} is missing the required argument '{arg}'", body)
            continue
        if not isinstance(arguments[arg], types):
            kind = " or ".join(t.__name__ for t in types)
            return _malformed(f"argument '{arg}' of {name} must be of type {kind}", body)
    return ParsedCall(kind="call", name=name, arguments=arguments)


def render_tool_call(name: str, arguments: dict[str, Any], thought: str = "") -> str:
    """One assistant reply holding one call, as the contract above writes it (what `parse_tool_call` reads):
    the optional free-text `thought` on its own line, then <tool_call>{"name": ..., "arguments": ...}</tool_call>.
    The scripted experts and the tests write their replies with it. A tag inside an argument (archived text
    that holds "</tool_call>" or "<think>") has its "<" written as the JSON escape \\u003c, so the reply
    parses back to exactly these arguments."""
    body = json.dumps({"name": name, "arguments": arguments})
    for tag in (OPEN_TAG, CLOSE_TAG, THINK_OPEN, THINK_CLOSE):  # only inside JSON strings: the rest has no "<"
        body = body.replace(tag, "\\u003c" + tag[1:])
    call = OPEN_TAG + body + CLOSE_TAG
    return f"{thought}\n{call}" if thought else call


def canonical_call(name: str, arguments: dict[str, Any]) -> str:
    """(tool name, arguments with sorted keys): the identity used by the redundancy penalty."""
    return name + ":" + json.dumps(arguments, sort_keys=True, ensure_ascii=False)
