"""Step, Segment and Trajectory: what one episode leaves behind (design.md "Trajectory JSON").

A trajectory with k successful compressions is split into k + 1 segments (memex.md
"Training"); each segment is the exact token sequence the policy saw and produced:
`prompt_ids` ([system, task] or [system, task, summary] with the generation prompt), then
`completion_ids` (assistant tokens interleaved with observation tokens), a `loss_mask`
(1 on tokens the engine sampled, 0 elsewhere) and `logprobs` (the engine's log-probs of
the sampled tokens, 0 elsewhere). The trained tokens are exactly the sampled ones, never
re-tokenised text (token-in / token-out).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

READING_TASK = "reading"  # Trajectory.task["kind"] of a reading episode
# An episode "ends in an error loop" when it is not won and its last ERROR_LOOP_TURNS turns all failed (a format
# error or a refused tool call): the policy repeating a call that fails, e.g. a CompressExperience cut at the
# turn cap or with anchors that are not in its context, until the step limit. A diagnostic of ours, not the
# paper's. In issue 26's CPU run, 2-10 of a GRPO step's 16 rollouts and 23 % (greedy) / 47 % (sampled) of the SFT
# start's held-out episodes ended this way (docs/results.md section 4).
ERROR_LOOP_TURNS = 5


@dataclass
class Step:
    assistant: str
    tool: str | None
    arguments: dict | None
    format_error: bool
    error: str | None
    observation: str
    working_tokens: int
    compressed: bool = False
    redundant: bool = False
    state_changing: bool = False  # an env action that may change the world (resets redundancy tracking)
    advances: bool = False  # an env action that showed new content (a reading page): tracking restarts empty

    @property
    def failed(self) -> bool:
        """A format error, or a tool call the tool refused (a rejected compression, a missed read)."""
        return self.format_error or self.error is not None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("state_changing")
        out.pop("advances")
        return out


def ends_in_error_loop(success: bool, steps: list[Step]) -> bool:
    """Not won, and the last ERROR_LOOP_TURNS turns all failed (see ERROR_LOOP_TURNS)."""
    tail = steps[-ERROR_LOOP_TURNS:]
    return not success and len(tail) == ERROR_LOOP_TURNS and all(s.failed for s in tail)


@dataclass
class Segment:
    first_step: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_step: int = -1
    # The segment's conversation (system, task, [summary], then assistant/observation turns): the
    # same list object the working context appends to until a compression replaces it.
    messages: list[dict] = field(default_factory=list)

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def extend(self, ids: list[int], *, trained: bool, logprobs: list[float] | None = None) -> None:
        self.completion_ids.extend(ids)
        self.loss_mask.extend([1 if trained else 0] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def to_json(self) -> dict[str, int]:
        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.completion_ids),
            "trained_tokens": self.trained_tokens,
        }


CRASH = "crash"  # end_reason of an episode lost to an env worker, engine or internal fault


@dataclass
class Trajectory:
    game: str
    task_type: str
    goal: str
    success: bool = False
    reward: dict[str, float] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    experience: dict[str, str] = field(default_factory=dict)
    end_reason: str = ""  # finish | env_done | step_limit | script_exhausted | context_limit | crash
    error: str | None = None  # why an episode was lost (a crash), if it was
    # What the env said of the task beyond its goal, for scoring (never shown to the policy): the reading env's
    # planted evidence and read budget (envs/reading.py), and the step at which its question was asked.
    task: dict[str, Any] = field(default_factory=dict)

    @property
    def reading(self) -> bool:
        """An episode of the reading env (envs/reading.py), scored by its evidence recall (rewards/reading.py)."""
        return self.task.get("kind") == READING_TASK

    @property
    def crashed(self) -> bool:
        """Lost to a fault that is not the policy's (env worker, engine, a bug): not a failure to learn from."""
        return self.end_reason == CRASH

    @property
    def error_loop(self) -> bool:
        return ends_in_error_loop(self.success, self.steps)

    @property
    def stats(self) -> dict[str, int]:
        return {
            "peak_working_tokens": max((s.working_tokens for s in self.steps), default=0),
            "num_steps": len(self.steps),
            "num_compress": sum(s.compressed for s in self.steps),
            "num_read": sum(1 for s in self.steps if s.tool == "ReadExperience" and s.error is None),
            # a CompressExperience the tool or the argument checks refused (the context stayed as it was)
            "num_compress_rejected": sum(1 for s in self.steps if s.tool == "CompressExperience" and not s.compressed),
            "num_read_miss": sum(1 for s in self.steps if s.tool == "ReadExperience" and s.error is not None),
            "num_redundant": sum(s.redundant for s in self.steps),
            "num_format_errors": sum(s.format_error for s in self.steps),
        }

    def to_json(self, with_tokens: bool = False) -> dict[str, Any]:
        """The design.md trajectory JSON; `with_tokens` adds each segment's ids, mask, log-probs and messages."""
        segments = []
        for seg in self.segments:
            item: dict[str, Any] = seg.to_json()
            if with_tokens:
                item.update(
                    prompt_ids=seg.prompt_ids,
                    completion_ids=seg.completion_ids,
                    loss_mask=seg.loss_mask,
                    logprobs=seg.logprobs,
                    messages=seg.messages,
                )
            segments.append(item)
        out = {
            "game": self.game,
            "task_type": self.task_type,
            "goal": self.goal,
            "success": self.success,
            "reward": self.reward,
            "steps": [s.to_json() for s in self.steps],
            "segments": segments,
            "experience": self.experience,
            "stats": self.stats,
            "end_reason": self.end_reason,
        }
        if self.error:
            out["error"] = self.error
        if self.task:
            out["task"] = self.task
        return out


def success_by_task_type(outcomes: Iterable[tuple[str, bool]]) -> dict[str, dict]:
    """{task_type: {"games", "success", "success_rate"}} over (task type, success) pairs, sorted by task type."""
    by_type: dict[str, list[bool]] = {}
    for task_type, success in outcomes:
        by_type.setdefault(task_type, []).append(bool(success))
    return {k: {"games": len(v), "success": sum(v), "success_rate": round(sum(v) / len(v), 4)}
            for k, v in sorted(by_type.items())}
