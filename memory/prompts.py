"""System prompt and task message (memex.md "The tools", "Context status"; paper section 6.2).

Kept compact on purpose: on a 2-core CPU every prompt token is prefilled at the start of
every segment. Tool schemas go through the chat template's `tools=` when it supports them;
otherwise `system_prompt(..., schemas_in_text=True)` writes them into the prompt in the
same JSON form.
"""

from __future__ import annotations

from common.trajectory import READING_TASK
from memory.parsing import COMPRESS, READ, TOOL_SCHEMAS

_BASE = """You are an agent in a household text game. Act only through tool calls: in every reply, \
think briefly, then make exactly one call in this form:
<tool_call>{"name": "execute_action", "arguments": {"action": "go to cabinet 1"}}</tool_call>
Game commands: look, inventory, go to X, open X, close X, take X from Y, move X to Y, examine X, \
use X, heat X with Y, cool X with Y, clean X with Y, slice X with Y. Object names must be exact \
(e.g. "apple 2"), as they appear in observations. Start with look: it works only once. \
Call finish when the task is done."""

_READING = """You are a memory controller. You read the trajectories of a web agent a few states at a time, \
for a colleague who will later ask questions about these environments. Act only through tool calls: in every \
reply, think briefly, then make exactly one call in this form:
<tool_call>{"name": "execute_action", "arguments": {"action": "next"}}</tool_call>
execute_action (any action) shows the next states. Archive what a question may need with CompressExperience: \
page contents and values, how values changed, procedures that worked, errors and their fixes, each block under \
an index that says what it holds. At the question, read the blocks that hold its answer with ReadExperience, \
then call finish."""

_MEMORY = """Memory: your working context is limited; after each observation you see its size. \
Before it passes the threshold, call CompressExperience: write a short summary (progress, plan and \
an index map: one line per index saying what it holds) and archive exact evidence in db_blocks, \
either {{"db_index", "db_content"}} or by anchors {{"db_index", "start_anchor", "mid_anchor", \
"end_anchor"}} copied from the context. The context is then replaced by your summary. \
Call ReadExperience with a db_index to get an archived block back instead of exploring again. \
The working-context threshold is {threshold} tokens."""


_SUMMARY_ONLY = """Memory: your working context is limited; after each observation you see its size. \
Before it passes the threshold, call CompressExperience with a short summary (progress, plan and every exact \
name you will need): the context is then replaced by your summary and nothing else is kept. \
The working-context threshold is {threshold} tokens."""

_CHAIN = """Memory: you do not see your earlier observations, only a numbered list of your own step \
summaries and the newest observation. Start every reply with one line `State: <what you know now and the \
action you take>`, with exact object names; that line is what you will remember of this step."""

_INSIGHTS = "Suggestions from similar solved tasks (check them against what you observe; they may not apply):"


def task_paragraph(kind: str) -> str:
    """The system prompt's task paragraph for a kind of task (`Trajectory.task["kind"]`): reading web-agent
    trajectories (envs/reading.py, and the LME-V2 controller that plays the same task) or the ALFWorld game."""
    return _READING if kind == READING_TASK else _BASE


def tool_schemas(tools: tuple[str, ...], store: bool = True) -> list[dict]:
    """The JSON schemas of `tools`; without a `store`, CompressExperience takes only its summary."""
    out = []
    for schema in TOOL_SCHEMAS:
        if schema["function"]["name"] not in tools:
            continue
        if schema["function"]["name"] == COMPRESS and not store:
            fn = schema["function"]
            params = {**fn["parameters"], "properties": {"summary": fn["parameters"]["properties"]["summary"]},
                      "required": ["summary"]}
            schema = {**schema, "function": {**fn, "description": "Replace your working context with a summary.",
                                             "parameters": params}}
        out.append(schema)
    return out


def system_prompt(tools: tuple[str, ...], threshold: int, schemas_in_text: bool, *, store: bool = True,
                  chain: bool = False, insights: tuple[str, ...] = (), base: str = "") -> str:
    """The system prompt of an agent (rollout/strategies.py): memory instructions only for what it has.

    `base` replaces the ALFWorld task paragraph (another task on the same loop, e.g. reading LME-V2
    trajectories as a memory controller, eval/lme/memory/memex.py)."""
    parts = [base or _BASE]  # the ALFWorld game's paragraph unless another is given (task_paragraph)
    if COMPRESS in tools or READ in tools:
        parts.append((_MEMORY if store else _SUMMARY_ONLY).format(threshold=threshold))
    if chain:
        parts.append(_CHAIN)
    if insights:
        parts.append("\n".join([_INSIGHTS, *(f"- {i}" for i in insights)]))
    if schemas_in_text:
        parts.append("Tools (name, JSON arguments; ? = optional):\n"
                     + "\n".join(map(_signature, tool_schemas(tools, store))))
    return "\n\n".join(parts)


def _signature(schema: dict) -> str:
    """One compact line per tool, from its JSON schema: `- name {"arg": type, "opt"?: type}: purpose`."""
    fn = schema["function"]
    params = fn["parameters"]
    required = set(params.get("required", []))
    args = []
    for name, spec in params.get("properties", {}).items():
        kind = spec.get("type", "any")
        if kind == "array":
            item = spec.get("items", {}).get("properties", {})
            kind = "[{" + ", ".join(item) + "}]"
        args.append(f'"{name}"{"" if name in required else "?"}: {kind}')
    purpose = fn["description"].split(". ")[0].rstrip(".")
    return f"- {fn['name']} {{{', '.join(args)}}}: {purpose}."


def task_message(observation: str) -> str:
    """The task message: the env's reset observation (modified ALFWorld: the task only)."""
    return observation.strip()
