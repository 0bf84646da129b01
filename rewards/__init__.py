"""Task reward and the three Memex penalties, composed into R (memex.md "Reward")."""

from rewards.memex import (
    context_penalty,
    format_penalty,
    mark_redundant,
    redundancy_penalty,
    score_trajectories,
    score_trajectory,
    task_reward,
)

__all__ = [
    "context_penalty",
    "format_penalty",
    "mark_redundant",
    "redundancy_penalty",
    "score_trajectories",
    "score_trajectory",
    "task_reward",
]
