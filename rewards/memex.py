"""R = R_task - P_context - P_redundancy - P_format (memex.md "Reward"; paper section 4.7).

Plain functions over the steps of a finished trajectory, each penalty in [0, 1] times its
weight. The env gives no reward shaping: it only says whether the task was won. The weights
have one home, `RewardConfig` (common/config.py); the agent loop never scores: whoever runs the
episodes (trainer, eval, replay, demonstrations) calls `score_trajectories` once.
"""

from __future__ import annotations

from collections.abc import Sequence

from common.config import RewardConfig
from common.trajectory import Step, Trajectory
from memory.parsing import MEMORY_TOOLS, canonical_call
from rewards.reading import evidence_recall


def task_reward(success: bool) -> float:
    """R_task: 1 on success, else 0."""
    return 1.0 if success else 0.0


def context_penalty(
    working_tokens: Sequence[int], skipped: Sequence[bool], threshold: int, weight: float
) -> float:
    """P_context = w * min(1, sum_t max(0, C_t - T) / (T * steps)).

    C_t is the working context after step t; `skipped` steps are left out of the sum: those in which a
    compression happened (their C_t is the fresh summary, the overflow was paid before) and, with
    `reward.charge_question_phase` false, a reading episode's question phase (`uncharged_steps`). The
    denominator counts all steps, as the paper's formula does.
    """
    steps = len(working_tokens)
    if steps == 0:
        return 0.0
    excess = sum(max(0, c - threshold) for c, skip in zip(working_tokens, skipped) if not skip)
    return weight * min(1.0, excess / (threshold * steps))


def uncharged_steps(traj: Trajectory, charge_question_phase: bool = True) -> list[bool]:
    """The steps P_context leaves out: compressions, and with `charge_question_phase` false (a deviation,
    RewardConfig) a reading episode's question step and every step after it."""
    asked = traj.task.get("question_step") if traj.reading and not charge_question_phase else None
    return [s.compressed or (asked is not None and n >= asked) for n, s in enumerate(traj.steps)]


def mark_redundant(steps: Sequence[Step]) -> list[bool]:
    """Which non-memory tool calls repeat one made since the last state-changing action.

    A call is identified by (tool name, arguments with sorted keys). A state-changing action
    (ALFWorld: pick up, take, put/move, open, close, use, clean, heat, cool, slice, toggle)
    starts a new window that holds only itself, so repeating it right away is redundant too. An action that
    showed new content (the reading env's page, `Step.advances`) starts an empty window: "next" again is not
    a repeat while there are pages.
    Memory tools, format errors and replies without a call are never counted.
    """
    flags: list[bool] = []
    seen: set[str] = set()
    for step in steps:
        if step.tool is None or step.format_error or step.tool in MEMORY_TOOLS:
            flags.append(False)
            continue
        key = canonical_call(step.tool, step.arguments or {})
        flags.append(key in seen)
        if step.advances:  # new content shown (a reading page): the same call next time is not a repeat
            seen = set()
        elif step.state_changing:
            seen = {key}
        else:
            seen.add(key)
    return flags


def _non_memory_calls(steps: Sequence[Step]) -> int:
    return sum(1 for s in steps if s.tool is not None and not s.format_error and s.tool not in MEMORY_TOOLS)


def redundancy_penalty(steps: Sequence[Step], weight: float) -> float:
    """P_redundancy = w * N_redundant / N_tool_calls, over non-memory tool calls."""
    calls = _non_memory_calls(steps)
    if calls == 0:
        return 0.0
    return weight * sum(mark_redundant(steps)) / calls


def format_penalty(steps: Sequence[Step], weight: float) -> float:
    """P_format = w * (steps with a malformed call / steps that attempted a call)."""
    attempted = sum(1 for s in steps if s.format_error or s.tool is not None)
    if attempted == 0:
        return 0.0
    return weight * sum(s.format_error for s in steps) / attempted


def score_trajectory(traj: Trajectory, threshold: int, weights: RewardConfig) -> dict[str, float]:
    """Mark redundant steps and fill `traj.reward` with the design.md reward block. A reading episode's
    R_task is its evidence recall, and its `success` is set here: every planted string reached the reader."""
    for step, flag in zip(traj.steps, mark_redundant(traj.steps)):
        step.redundant = flag
    if traj.reading:  # R_task is the evidence recall (rewards/reading.py); a success reads it all
        task = evidence_recall(traj)
        traj.success = task == 1.0
    else:
        task = task_reward(traj.success)
    reward = {
        "task": task,
        "context": context_penalty([s.working_tokens for s in traj.steps],
                                   uncharged_steps(traj, weights.charge_question_phase), threshold, weights.lambda_ctx),
        "redundancy": redundancy_penalty(traj.steps, weights.lambda_red),
        "format": format_penalty(traj.steps, weights.lambda_fmt),
    }
    reward["total"] = reward["task"] - reward["context"] - reward["redundancy"] - reward["format"]
    traj.reward = reward
    return reward


def score_trajectories(trajs: Sequence[Trajectory], threshold: int, weights: RewardConfig) -> None:
    """R for every finished trajectory of a run: T is memory.threshold, the weights the run's `reward` section."""
    for traj in trajs:
        score_trajectory(traj, threshold, weights)
