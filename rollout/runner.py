"""The batched rollout runner: many episodes in flight, one engine, one env pool.

Each round: every live episode asks for its next turn, the engine generates them together,
memory tools run at once inside each episode, and the env actions go to the env pool
together (its workers step in parallel). Finished episodes release their engine state and
their env. The runner never drops an episode: a crashed env worker ends its episode as
failed with the reason (envs/pool.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tqdm.auto import tqdm

from common.config import Config
from common.engine import Engine, GenerationRequest
from common.trajectory import Trajectory
from memory.context import ChatRenderer
from memory.prompts import tool_schemas
from memory.store import ExperienceStore, open_store
from rollout.episode import MEMEX_AGENT, Episode
from rollout.strategies import AgentSpec

log = logging.getLogger(__name__)


class Envs(Protocol):
    def reset_many(self, requests: list[tuple[str, str]]) -> list: ...
    def step_many(self, requests: list[tuple[str, str]]) -> list: ...
    def close_episode(self, episode_id: str) -> None: ...


@dataclass
class RolloutTimes:
    """Where rollout time went: the model versus everything else (parsing, context, tokenising)."""

    engine_s: float = 0.0
    env_s: float = 0.0
    agent_s: float = 0.0
    turns: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.engine_s + self.env_s + self.agent_s


def env_kwargs(cfg: Config) -> dict:
    """ModifiedAlfWorld keyword arguments from the config's env section."""
    e = cfg.env
    return {
        "hide_admissible": e.hide_admissible,
        "hide_initial_room": e.hide_initial_room,
        "look_once": e.look_once,
        "demangle": e.demangle,
        "seed": e.seed,
    }


def open_envs(cfg: Config, num_workers: int | None = None) -> Envs:
    """The env pool (num_workers processes; default cfg.env.num_workers), or in-process envs for 0."""
    from envs.inline import InlineEnvs
    from envs.pool import EnvPool

    workers = cfg.env.num_workers if num_workers is None else num_workers
    return EnvPool(workers, env_kwargs(cfg)) if workers > 0 else InlineEnvs(env_kwargs(cfg))


def make_renderer(tokenizer, cfg: Config, agent: AgentSpec = MEMEX_AGENT) -> ChatRenderer:
    return ChatRenderer(tokenizer, tool_schemas(agent.tools, agent.store), cfg.rollout.observation_role)


def run_episodes(
    jobs: list[tuple[str, str]],
    engine: Engine,
    envs: Envs,
    renderer: ChatRenderer,
    cfg: Config,
    *,
    agent: AgentSpec = MEMEX_AGENT,
    store_factory: Callable[[str], ExperienceStore] | None = None,
    progress: bool = False,
    times: RolloutTimes | None = None,
) -> list[Trajectory]:
    """Play `jobs` = [(episode_id, game_file), ...] to the end; trajectories in job order."""
    times = times if times is not None else RolloutTimes()
    make_store = store_factory or (
        lambda _id: open_store(cfg.memory.backend, cfg.memory.sqlite_path, namespace=_id)
    )
    episodes = {eid: Episode(eid, str(game), renderer, make_store(eid), memory=cfg.memory, env=cfg.env,
                              rollout=cfg.rollout, agent=agent) for eid, game in jobs}
    t0 = time.perf_counter()
    for answer in envs.reset_many([(eid, str(game)) for eid, game in jobs]):
        episodes[answer.episode_id].start(answer)
    times.env_s += time.perf_counter() - t0

    bar = tqdm(total=len(jobs), desc="episodes", disable=not progress, leave=False)

    def release(finished: list[Episode]) -> None:
        for ep in finished:
            engine.release(ep.id)
            envs.close_episode(ep.id)
            ep.store.close()
        bar.update(len(finished))

    release([ep for ep in episodes.values() if ep.done])  # lost at reset (env crash)
    live = [ep for ep in episodes.values() if not ep.done]
    turn = 0
    while live:
        turn += 1
        bar.set_postfix(turn=turn, playing=len(live), refresh=True)  # a long turn still shows progress
        t0 = time.perf_counter()
        requests = [GenerationRequest(ep.id, ep.request_ids(), ep.max_new_tokens(), ep) for ep in live]
        t1 = time.perf_counter()
        completions = engine.generate(requests)
        t2 = time.perf_counter()
        actions = []
        for ep, completion in zip(live, completions):
            action = ep.on_completion(completion)
            if action is not None:
                actions.append((ep.id, action))
        t3 = time.perf_counter()
        answers = envs.step_many(actions) if actions else []
        t4 = time.perf_counter()
        for answer in answers:
            episodes[answer.episode_id].on_env_result(answer)
        t5 = time.perf_counter()
        times.engine_s += t2 - t1
        times.env_s += t4 - t3
        times.agent_s += (t1 - t0) + (t3 - t2) + (t5 - t4)
        times.turns += len(live)
        release([ep for ep in live if ep.done])
        live = [ep for ep in live if not ep.done]
    bar.close()
    return [episodes[eid].traj for eid, _ in jobs]
