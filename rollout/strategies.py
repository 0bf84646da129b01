"""Context strategies: how memex and each baseline agent manage their context, on one env, engine and agent loop.

`AgentSpec` says which tools an agent has and what stays in its context; `Episode`
(rollout/episode.py) applies it after every observation. The strategies compared in the
ALFWorld evaluation (design.md `eval alfworld --agent`):

- `memex` (the default): CompressExperience + ReadExperience over the experience store, the
  context status as soft trigger (memex.md);
- `full`: no memory tools, the whole history in context (until the window is full);
- `truncate`: no memory tools, only the last `keep_turns` (reply, observation) turns kept
  (M² paper: a history window of 5 was the best such baseline, m2.md);
- `summary`: CompressExperience without an experience store: the summary replaces the context,
  nothing is archived and there is no ReadExperience (the release's compress-only mode: lossy);
- `m2`: M²'s internal memory: every reply starts with a one-line state summary; the chain of
  those summaries replaces the history, only the newest observation stays; its external memory
  (insights retrieved for the task, eval/m2_insights.py) goes into the system prompt (m2.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import AGENT_NAMES
from memory.parsing import COMPRESS, EXECUTE_ACTION, FINISH, READ

CHAIN_HEADER = "Your step summaries so far (older observations were dropped):"
_STATE = re.compile(r"^\s*State:\s*(.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class AgentSpec:
    name: str = "memex"
    tools: tuple[str, ...] = (EXECUTE_ACTION, COMPRESS, READ, FINISH)
    status: bool = True  # the context status after each observation (the soft trigger to compress)
    store: bool = True  # CompressExperience archives db_blocks in the experience store
    keep_turns: int = 0  # > 0: only the last keep_turns (reply, observation) pairs stay in context
    chain: bool = False  # the per-step state-summary chain replaces the history (M²)
    insights: tuple[str, ...] = field(default=())  # suggestions for the system prompt (M²)
    # M²: the insights for a task, from its goal (eval/m2_insights.py InsightBank.retrieve); after `insights`.
    retrieve: Callable[[str], tuple[str, ...]] | None = field(default=None, compare=False, repr=False)
    task_prompt: str = ""  # the system prompt's task paragraph ("" = the ALFWorld one, memory/prompts.py)

    def insights_for(self, goal: str) -> tuple[str, ...]:
        return self.insights + (self.retrieve(goal) if self.retrieve is not None else ())

    @property
    def optional_arguments(self) -> tuple[str, ...]:
        return () if self.store else ("db_blocks",)


def make_agent(name: str, keep_turns: int = 5, insights: tuple[str, ...] = (),
               retrieve: Callable[[str], tuple[str, ...]] | None = None) -> AgentSpec:
    """The AgentSpec of a strategy name (AGENT_NAMES); ValueError for another name."""
    plain = (EXECUTE_ACTION, FINISH)
    specs = {
        "memex": AgentSpec(),
        "full": AgentSpec("full", plain, status=False),
        "truncate": AgentSpec("truncate", plain, status=False, keep_turns=keep_turns),
        "summary": AgentSpec("summary", (EXECUTE_ACTION, COMPRESS, FINISH), store=False),
        "m2": AgentSpec("m2", plain, status=False, chain=True, insights=tuple(insights), retrieve=retrieve),
    }
    if name not in specs:
        raise ValueError(f"unknown agent {name!r}: use one of {', '.join(AGENT_NAMES)}")
    return specs[name]


def state_summary(reply: str) -> str:
    """The `State: ...` line an M² reply starts with; else the reply's text before its tool call."""
    found = _STATE.search(reply)
    if found:
        return found.group(1)
    return " ".join(reply.split("<tool_call>", 1)[0].split())[:300]


def chain_message(summaries: list[str], observation: dict) -> list[dict]:
    """M²'s working context: the summary chain, then the newest observation (as its own message)."""
    lines = [CHAIN_HEADER, *(f"{i}. {s}" for i, s in enumerate(summaries, 1) if s)]
    return [{"role": "user", "content": "\n".join(lines)}, observation]


def last_turns(working: list[dict], keep_turns: int) -> list[dict] | None:
    """The last `keep_turns` (assistant, observation) pairs of `working`, or None when nothing is dropped."""
    if len(working) <= 2 * keep_turns:
        return None
    return working[-2 * keep_turns :]
