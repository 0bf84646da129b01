"""The batched rollout runner: many episodes in flight, one engine, one env pool.

Each round: every live episode asks for its next turn, the engine generates them together,
memory tools run at once inside each episode, and the env actions go to the env pool
together (its workers step in parallel). Finished episodes release their engine state and
their env. The runner never drops an episode and no episode ends the run: a crashed env worker
(envs/pool.py), an engine that fails on a request, or an internal error while handling a reply
ends that episode with `end_reason` crash and the reason (`Episode.crash`); the others play on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from common.config import Config, MemoryConfig
from common.engine import Completion, Engine, GenerationRequest
from common.errors import MemexError
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
    if workers > 0:
        return EnvPool(workers, env_kwargs(cfg), timeout=cfg.env.step_timeout_s)
    return InlineEnvs(env_kwargs(cfg))


def make_renderer(tokenizer, cfg: Config, agent: AgentSpec = MEMEX_AGENT) -> ChatRenderer:
    thinking = {"auto": None, "always": True, "never": False}[cfg.model.thinking]
    return ChatRenderer(tokenizer, tool_schemas(agent.tools, agent.store), cfg.rollout.observation_role, thinking)


SQLITE_FILE = "memory.sqlite"  # the durable experience store of a run, in its run directory by default


def episode_stores(memory: MemoryConfig, run_dir: str | Path | None) -> Callable[[str], ExperienceStore]:
    """Each episode's experience store, by episode id.

    In memory: a fresh store per episode. SQLite (durable): one file, `memory.sqlite_path` or else
    RUN/memory.sqlite, with each episode in its own namespace `RUNID/EPISODE`, RUNID fresh for every
    call: episode ids repeat across runs (`replay`, `eval-0`, `s1-...`), and a block one run wrote
    must never be read by another run's episode.
    """
    if memory.backend != "sqlite":
        return lambda _id: open_store(memory.backend)
    path = memory.sqlite_path or (str(Path(run_dir) / SQLITE_FILE) if run_dir is not None else "")
    if not path:
        raise MemexError("memory.backend=sqlite needs memory.sqlite_path here (this command has no run directory)")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    log.info("experience stores: %s, namespaces %s/EPISODE", path, run_id)
    return lambda episode_id: open_store("sqlite", path, namespace=f"{run_id}/{episode_id}")


def generate_each(engine: Engine, requests: list[GenerationRequest]) -> list[Completion | str]:
    """The engine's completions in request order; where generation failed, the reason (a str).

    One batched call; if it raises, each request is retried alone, so one bad request (a prompt
    the engine refuses, a server error) loses its own episode only.
    """
    try:
        completions = engine.generate(requests)
        if len(completions) == len(requests):
            return list(completions)
        raise RuntimeError(f"{len(completions)} completions for {len(requests)} requests")
    except Exception as exc:
        log.warning("engine failed on a batch of %d (%s: %s); retrying one by one", len(requests),
                    type(exc).__name__, exc)
    out: list[Completion | str] = []
    for request in requests:
        try:
            (completion,) = engine.generate([request])
            out.append(completion)
        except Exception as exc:
            out.append(f"engine: {type(exc).__name__}: {exc}")
    return out


def take_reply(ep: Episode, completion: Completion | str) -> str | None:
    """Hand one engine answer to its episode; the env action it asks for, if any. A failed generation (a str) or an
    internal error on the reply ends that episode alone (`Episode.crash`)."""
    if isinstance(completion, str):
        ep.crash(completion)
        return None
    try:
        return ep.on_completion(completion)
    except Exception as exc:  # a bug of ours, reached by this reply: lose the episode, not the run
        log.exception("episode %s: internal error on a reply", ep.id)
        ep.crash(f"internal error on the reply: {type(exc).__name__}: {exc}")
        return None


def _request(ep: Episode) -> GenerationRequest:
    return GenerationRequest(ep.id, ep.request_ids(), ep.max_new_tokens(), ep)


def _play_in_rounds(live: list[Episode], episodes: dict[str, Episode], engine: Engine, envs: Envs,
                    times: RolloutTimes, bar, release: Callable[[list[Episode]], None]) -> None:
    """rollout.lockstep_turns (and every engine that batches whole calls): each round one engine call for every live
    episode, then their env actions stepped together; a round waits for its longest reply."""
    turn = 0
    while live:
        turn += 1
        bar.set_postfix(turn=turn, playing=len(live), refresh=True)  # a long turn still shows progress
        t0 = time.perf_counter()
        requests = [_request(ep) for ep in live]
        t1 = time.perf_counter()
        completions = generate_each(engine, requests)
        t2 = time.perf_counter()
        actions = []
        for ep, completion in zip(live, completions):
            action = take_reply(ep, completion)
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


def _play_unpaced(live: list[Episode], engine: Engine, envs: Envs, times: RolloutTimes, bar,
                  release: Callable[[list[Episode]], None]) -> None:
    """An engine that takes concurrent requests (a vLLM server): every episode's turn is sent on its own, from a
    thread of its own, as soon as the episode is ready, so no episode waits for another's reply and the server
    batches whatever is in flight. Replies, memory tools, env steps and stores are handled here, in the calling
    thread, one reply at a time (SQLite connections and the env pool stay on this thread)."""
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    inflight: dict = {}
    with ThreadPoolExecutor(max_workers=max(1, len(live)), thread_name_prefix="turn") as pool:

        def send(ep: Episode) -> None:
            t0 = time.perf_counter()
            request = _request(ep)
            times.agent_s += time.perf_counter() - t0
            inflight[pool.submit(generate_each, engine, [request])] = ep

        for ep in live:
            send(ep)
        while inflight:
            bar.set_postfix(turns=times.turns, playing=len(inflight), refresh=False)
            t0 = time.perf_counter()
            ready, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            times.engine_s += time.perf_counter() - t0  # waiting for the engine, with nothing else to do
            for future in ready:
                ep = inflight.pop(future)
                t1 = time.perf_counter()
                action = take_reply(ep, future.result()[0])
                env_s = 0.0
                if action is not None:
                    t2 = time.perf_counter()
                    (answer,) = envs.step_many([(ep.id, action)])
                    env_s = time.perf_counter() - t2
                    ep.on_env_result(answer)
                times.env_s += env_s
                times.agent_s += time.perf_counter() - t1 - env_s
                times.turns += 1
                if ep.done:
                    release([ep])
                else:
                    send(ep)


def run_episodes(
    jobs: list[tuple[str, str]],
    engine: Engine,
    envs: Envs,
    renderer: ChatRenderer,
    cfg: Config,
    *,
    agent: AgentSpec = MEMEX_AGENT,
    store_factory: Callable[[str], ExperienceStore] | None = None,
    run_dir: str | Path | None = None,
    progress: bool = False,
    times: RolloutTimes | None = None,
) -> list[Trajectory]:
    """Play `jobs` = [(episode_id, game_file), ...] to the end; trajectories in job order.

    The experience stores come from `store_factory`, else `episode_stores(cfg.memory, run_dir)`.
    """
    times = times if times is not None else RolloutTimes()
    make_store = store_factory or episode_stores(cfg.memory, run_dir)
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
    if engine.concurrent and not cfg.rollout.lockstep_turns:
        _play_unpaced(live, engine, envs, times, bar, release)
    else:
        _play_in_rounds(live, episodes, engine, envs, times, bar, release)
    bar.close()
    return [episodes[eid].traj for eid, _ in jobs]
