"""One episode of the Memex agent (memex.md; paper section 4.5, "the Memex agent loop").

    policy reply -> parse one tool call -> CompressExperience / ReadExperience (memory)
                                        -> execute_action (env) / finish
                 -> observation + context status -> next reply

`Episode` is a small state machine so that a runner can drive many episodes at once: it
hands out the token ids to condition on (`request_ids`), takes the engine's completion
(`on_completion`), returns the env action to run if any, and takes the env's answer
(`on_env_result`). The episode ends at `finish`, at the env's end, at the step limit, when
the context window is full, when a scripted policy runs out, or when its env worker crashed
(then the episode is reported as failed with the reason, never dropped).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from common.config import EnvConfig, MemoryConfig, RolloutConfig
from common.engine import Completion, valid_unicode
from common.trajectory import CRASH, Step, Trajectory
from memory.catalog import catalog_text
from memory.context import ChatRenderer, WorkingContext
from memory.parsing import (
    EXECUTE_ACTION,
    FINISH,
    NO_CALL_MESSAGE,
    READ,
    answer_part,
    parse_tool_call,
)
from memory.prompts import system_prompt, task_message, task_paragraph
from memory.store import ExperienceStore
from memory.tools import run_compress, run_read
from rollout.strategies import AgentSpec, chain_message, last_turns, state_summary

if TYPE_CHECKING:
    from envs.pool import EnvResult

MEMEX_AGENT = AgentSpec()
MEMEX_TOOLS = MEMEX_AGENT.tools
FINISHED_MESSAGE = "Episode finished."


def malformed_message(error: str | None, completion: Completion) -> str:
    """The observation after a format error; a reply that hit the turn's token limit is told so first: its call
    was cut, not mistyped, and the same call again would be cut again (memex.md P_format counts it either way)."""
    message = error or "Format error."
    if completion.finish_reason != "length":
        return message
    return (f"Your reply was cut at the turn's limit of {len(completion.token_ids)} tokens before the call ended, so "
            f"nothing was done; send a shorter call. {message}")


class Episode:
    """The agent loop of one episode, driven turn by turn by a runner."""

    def __init__(
        self,
        episode_id: str,
        game: str,
        renderer: ChatRenderer,
        store: ExperienceStore,
        *,
        memory: MemoryConfig,
        env: EnvConfig,
        rollout: RolloutConfig,
        agent: AgentSpec = MEMEX_AGENT,
    ):
        self.id = episode_id
        self.renderer = renderer
        self.store = store
        self.memory, self.env, self.rollout = memory, env, rollout  # the settings an episode reads
        self.agent = agent  # what stays in context (rollout/strategies.py): memex or a baseline
        self.tools = agent.tools
        self._chain: list[str] = []  # M²: the state summary of every reply
        self.traj = Trajectory(game=game, task_type="", goal="")
        self.context: WorkingContext | None = None
        self.done = False
        self.last_info: dict = {}  # the env's latest info (experts read the plan and admissible commands)
        self._pending: Step | None = None  # the turn waiting for the env's answer

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, answer: EnvResult) -> None:
        """Build [system, task] from the env's reset answer."""
        if answer.crashed:
            self.crash(f"env worker: {answer.error}")
            return
        info = self.last_info = answer.info
        self.traj.task_type = info.get("task_type", "")
        self.traj.goal = info.get("goal", "")
        self.traj.task = dict(info.get("task") or {})
        a = self.agent
        system = system_prompt(a.tools, self.memory.threshold, not self.renderer.template_has_tools,
                               store=a.store, chain=a.chain, insights=a.insights_for(self.traj.goal),
                               base=a.task_prompt or task_paragraph(self.traj.task.get("kind", "")))
        self.context = WorkingContext(
            self.renderer, system, task_message(answer.obs), self.memory.threshold, self.memory.warn_ratio,
            show_status=a.status, anchor_scope=self.memory.anchor_scope,
        )

    def request_ids(self) -> list[int]:
        assert self.context is not None
        return self.context.token_ids()

    def max_new_tokens(self) -> int:
        room = self.rollout.max_context_tokens - len(self.request_ids())
        return max(0, min(self.rollout.max_new_tokens, room))

    def on_completion(self, completion: Completion) -> str | None:
        """Take one assistant turn; return the env action to execute, or None if handled here."""
        assert self.context is not None and not self.done
        if completion.finish_reason == "exhausted":
            self._end("script_exhausted")
            return None
        step = len(self.traj.steps)
        if valid_unicode(completion.text) is not completion.text:
            completion = replace(completion, text=valid_unicode(completion.text))
        self.context.add_assistant(
            completion.text, completion.token_ids, completion.logprobs, step, trained=completion.trained
        )
        parsed = parse_tool_call(completion.text, self.tools, self.agent.optional_arguments, self.renderer.thinking,
                                 archive=self.store)
        if self.agent.chain:
            self._chain.append(state_summary(answer_part(completion.text, self.renderer.thinking)))
        record = Step(
            assistant=completion.text,
            tool=parsed.name,
            arguments=parsed.arguments,
            format_error=parsed.format_error,
            error=parsed.error,
            observation="",
            working_tokens=0,
        )
        if parsed.kind == "malformed":
            return self._observe(record, malformed_message(parsed.error, completion))
        if parsed.kind == "none":
            return self._observe(record, NO_CALL_MESSAGE)
        args = parsed.arguments or {}
        if parsed.name == EXECUTE_ACTION:
            self._pending = record
            return args["action"].strip()
        if parsed.name == FINISH:
            return self._observe(record, FINISHED_MESSAGE, end="finish")
        if parsed.name == READ:
            outcome = run_read(args, self.store, self.memory.fallback_top_k if self.memory.semantic_fallback else 0)
            record.error = outcome.error
            return self._observe(record, outcome.observation)
        outcome = run_compress(
            args, self.context, self.store if self.agent.store else None, step, self.memory.summary_max_tokens, self.memory.summary_cap_mode
        )
        record.error = outcome.error
        if not outcome.compressed:
            return self._observe(record, outcome.observation)
        record.compressed = True
        record.observation = outcome.observation
        record.working_tokens = self.context.working_tokens
        return self._record(record)

    def on_env_result(self, answer: EnvResult) -> None:
        """Take the env's answer to the pending execute_action."""
        assert self._pending is not None
        record, self._pending = self._pending, None
        if answer.crashed:
            record.error = answer.error
            record.observation = f"Environment error: {answer.error}"
            self.traj.steps.append(record)
            self.crash(f"env worker: {answer.error}")
            return
        self.last_info = answer.info
        record.state_changing = bool(answer.info.get("state_changing", False))
        record.advances = bool(answer.info.get("advances", False))
        if answer.info.get("new_context"):
            self._ask(record, answer)
            return
        won = bool(answer.info.get("won", False)) or answer.terminated
        self.traj.success = self.traj.success or won
        end = "env_done" if (answer.terminated or answer.truncated) else None
        self._observe(record, answer.obs.strip(), end=end)

    def crash(self, error: str) -> None:
        """End the episode for a fault that is not the policy's (env worker, engine, internal error).

        It ends with `end_reason` crash and the reason; GRPO leaves it out of its group
        (training/batching.py `advantages_for`) and the metrics count it.
        """
        if not self.done:
            self._end(CRASH, error=error)

    # --- internals ----------------------------------------------------------------------------
    def _ask(self, record: Step, answer: EnvResult) -> None:
        """The env asks its question (envs/reading.py): the next segment starts from a fresh working context
        holding only the question and the catalog of the archive (memory/catalog.py); the step is recorded in
        the trajectory's task for scoring (rewards/reading.py)."""
        assert self.context is not None
        catalog = answer.info.get("catalog") or {}
        body = answer.obs.strip()
        if catalog:
            body += "\n" + catalog_text(self.store, str(catalog.get("query", "")), int(catalog.get("shortlist", 12)),
                                         self.memory.catalog_rank_chars)
        step = len(self.traj.steps)
        self.traj.task["question_step"] = step
        record.observation = body
        record.working_tokens = self.context.new_task(body, step)
        self._record(record)

    def _observe(self, record: Step, body: str, end: str | None = None) -> None:
        assert self.context is not None
        record.observation, record.working_tokens = self.context.add_observation(body, self.store.indices())
        if end is None:
            record.working_tokens = self._apply_context_policy(len(self.traj.steps), record.working_tokens)
        self._record(record, end)
        return None

    def _apply_context_policy(self, step: int, working: int) -> int:
        """A baseline's context after an observation (truncate: last k turns; M²: summary chain); W after it."""
        assert self.context is not None
        a, messages = self.agent, self.context.messages
        if a.chain:
            return self.context.rebuild(chain_message(self._chain, messages[-1]), step)
        if a.keep_turns:
            kept = last_turns(messages[2:], a.keep_turns)
            if kept is not None:
                return self.context.rebuild(kept, step)
        return working

    def _record(self, record: Step, end: str | None = None) -> None:
        self.traj.steps.append(record)
        if end is not None:
            self._end(end)
        elif len(self.traj.steps) >= self.env.max_steps:
            self._end("step_limit")
        elif self.max_new_tokens() == 0:
            self._end("context_limit")
        return None

    def _end(self, reason: str, error: str | None = None) -> None:
        self.done = True
        self.traj.end_reason = reason
        if error:
            self.traj.error = error
            self.traj.success = False
        if self.context is not None:
            self.traj.segments = self.context.segments
        self.traj.experience = self.store.as_dict()
