"""Envs stepped in this process, with the same interface as `envs.pool.EnvPool`.

For one-off episodes (`memexrl replay`, tests, debugging) where starting worker processes
costs more than it saves. Sequential, so TextWorld's parser is never used from two threads.
"""

from __future__ import annotations

from typing import Any

from envs.games import open_env
from envs.pool import EnvResult


class InlineEnvs:
    """reset_many / step_many / close_episode on envs living in this process."""

    def __init__(self, env_kwargs: dict[str, Any] | None = None):
        self.env_kwargs = dict(env_kwargs or {})
        self.envs: dict[str, Any] = {}

    def reset_many(self, requests: list[tuple[str, str]]) -> list[EnvResult]:
        out = []
        for episode_id, game in requests:
            env = self.envs[episode_id] = open_env(game, **self.env_kwargs)
            obs, info = env.reset()
            out.append(EnvResult(episode_id, obs, 0.0, False, False, info))
        return out

    def step_many(self, requests: list[tuple[str, str]]) -> list[EnvResult]:
        return [EnvResult(eid, *self.envs[eid].step(action)) for eid, action in requests]

    def close_episode(self, episode_id: str) -> None:
        env = self.envs.pop(episode_id, None)
        if env is not None:
            env.close()

    def close(self) -> None:
        for episode_id in list(self.envs):
            self.close_episode(episode_id)

    def __enter__(self) -> InlineEnvs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
