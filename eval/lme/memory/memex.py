"""`memex`: the Memex policy as the LME-V2 memory controller (the mission's last step).

Insert: the policy reads each haystack trajectory as an episode of the same agent loop it was
trained in (rollout/episode.py, same tools, same working context and context status): the task
message is the trajectory's goal, start URL and outcome; every `execute_action` (any action)
shows the next `states_per_chunk` states (`State k` + thought + action + AXTree, capped); after
the last one the observation asks it to archive what matters and finish. What it archives with
CompressExperience (anchor blocks copied exactly from the AXTree text, explicit blocks it
writes) goes into a durable SQLite experience store (memory/store.py) under the key
`t<NNNN>-<its db_index>` of the trajectory's ordinal, with the block's index-map line plus the
trajectory's goal as its description: the index catalog. Nothing else is stored: what the
policy did not archive, the memory does not have.

Query: the policy gets the question and a shortlist of the catalog (bm25s over keys,
descriptions and block openings: `ExperienceStore.suggest`, since a 500-trajectory catalog does
not fit in a prompt), with ReadExperience and finish as its only tools; it reads at most
`max_reads` blocks (the episode ends at finish, at the read budget, or at the step limit). The
blocks it read, in reading order, are the memory context. Any checkpoint can be the controller
(the ALFWorld GRPO one, the SFT one, a base model): `extra["checkpoint"]`, run by the engine of
`extra["config"]` (memexrl Config: transformers or vLLM, eval.temperature), or `extra["engine"]`,
an (engine, tokenizer) pair built by the caller. Other settings (`--set key=value`):
states_per_chunk (2), state_max_chars (2000), max_reads (3), shortlist (12), insert_batch
(rollout.batch_size: trajectories read together, one batched engine call per turn), workdir.

Save/load: the SQLite file is the memory; `save` copies it (sqlite backup API) and `load`
reopens it, so insert -> close -> reopen -> query gives the same context (greedy decoding).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
from pathlib import Path

from tqdm import tqdm

from common.config import Config, load_config
from common.engine import GenerationRequest
from common.errors import MemexError
from envs.pool import EnvResult
from eval.lme.memory.base import Memory, MemoryOptions, register
from eval.lme.records import render_state
from memory.parsing import COMPRESS, EXECUTE_ACTION, FINISH, READ
from memory.store import BlockWrite, InMemoryStore, SQLiteStore
from rollout.episode import Episode
from rollout.strategies import AgentSpec
from training.policy import resolve_checkpoint

log = logging.getLogger(__name__)

STORE_FILE = "memex_store.sqlite"
EPISODES_FILE = "insert_episodes.jsonl"  # the reading episodes (trajectory JSON), one line per trajectory
TAIL_STEPS = 3  # turns after the last chunk to archive and finish
BLOCKS, META = "lme", "lme-meta"  # store namespaces: the archived blocks; the inserted trajectory ids
READ_TASK = """You are a memory controller reading the trajectory of a web agent, a few states at a time. \
Act only through tool calls: in every reply, think briefly, then make exactly one call in this form:
<tool_call>{"name": "execute_action", "arguments": {"action": "next"}}</tool_call>
execute_action (any action) shows the next states. A colleague will later ask questions about this \
environment: page contents, values and how they changed, procedures that worked, errors and their fixes. \
Archive what they may need with CompressExperience (exact text by anchors, facts you write in db_content), \
then call finish."""
QUERY_TASK = """You are a memory controller answering from an archive of web-agent trajectories. \
Act only through tool calls: in every reply, think briefly, then make exactly one call in this form:
<tool_call>{"name": "ReadExperience", "arguments": {"db_index": "t0001-facts"}}</tool_call>
Read the archived blocks that can answer the question, then call finish."""


def trajectory_task(trajectory: dict, n_states: int) -> str:
    return (f"Trajectory goal: {trajectory.get('goal', '')}\nStart URL: {trajectory.get('start_url', '')}\n"
            f"Outcome: {trajectory.get('outcome') or 'unknown'}\nStates: {n_states}. "
            "Call execute_action to see the first states.")


class TrajectoryPager:
    """An env (EnvResult answers) that shows a trajectory `per_chunk` states at a time."""

    def __init__(self, trajectory: dict, per_chunk: int, max_chars: int):
        self.trajectory, self.per_chunk, self.max_chars = trajectory, per_chunk, max_chars
        self.next_state = 0

    def reset(self) -> EnvResult:
        return self._answer(trajectory_task(self.trajectory, len(self.trajectory["states"])))

    def step(self, _action: str) -> EnvResult:
        states = self.trajectory["states"]
        if self.next_state >= len(states):
            return self._answer("No more states. Archive what matters with CompressExperience, then call finish.")
        chunk = range(self.next_state, min(len(states), self.next_state + self.per_chunk))
        self.next_state = chunk.stop
        text = "\n\n".join(render_state(self.trajectory, k, self.max_chars) for k in chunk)
        if self.next_state >= len(states):
            text += "\n\nThat was the last state. Archive what matters with CompressExperience, then call finish."
        return self._answer(text)

    def _answer(self, obs: str) -> EnvResult:
        return EnvResult("lme", obs, 0.0, False, False, {"goal": self.trajectory.get("goal", "")})


@register
class MemexMemory(Memory):
    """The trained policy archives trajectories at insert and reads its archive back at query."""

    name = "memex"

    def __init__(self, options: MemoryOptions, store_dir: Path | None = None):
        super().__init__(options)
        x = options.extra
        self.cfg: Config = x.get("config") or load_config(None, [])
        self.checkpoint = resolve_checkpoint(str(x.get("checkpoint") or self.cfg.model.name), "--checkpoint")
        self.per_chunk = int(x.get("states_per_chunk", 2))
        self.max_chars = int(x.get("state_max_chars", 2000))
        self.max_reads = int(x.get("max_reads", 3))
        self.shortlist = int(x.get("shortlist", 12))
        self.dir = Path(store_dir or x.get("workdir") or "runs/lme-memex")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = SQLiteStore(self.dir / STORE_FILE, BLOCKS)
        self.meta = SQLiteStore(self.dir / STORE_FILE, META)
        self._engine = None
        self._pending: list[dict] = []  # inserted, not read yet (flush reads them in one batch)
        self.batch = int(x.get("insert_batch", self.cfg.rollout.batch_size))
        self.read_spec = AgentSpec("memex-read", (EXECUTE_ACTION, COMPRESS, READ, FINISH), task_prompt=READ_TASK)
        self.query_spec = AgentSpec("memex-query", (READ, FINISH), status=False, task_prompt=QUERY_TASK)

    # --- the policy -------------------------------------------------------------------------------
    def _engine_and_renderer(self):
        if self._engine is None:
            from eval.alfworld import make_eval_engine
            from rollout.runner import make_renderer

            given = self.options.extra.get("engine")  # (engine, tokenizer) already built, e.g. a ScriptedEngine
            engine, tokenizer = given or make_eval_engine(self.cfg, self.checkpoint, self.dir)
            self._engine = (engine, {s.name: make_renderer(tokenizer, self.cfg, s)
                                     for s in (self.read_spec, self.query_spec)})
        return self._engine

    def _play(self, games: list[tuple[Episode, TrajectoryPager]]) -> None:
        """Drive episodes to their ends together: one engine call per turn for all that still run (the
        engine batches them: rollout.batch_size), each env answer from its own pager."""
        engine, _ = self._engine_and_renderer()
        active = list(games)
        with tqdm(total=len(games), desc="memex reads trajectories", unit="traj", leave=False) as bar:
            while active:
                requests = [GenerationRequest(ep.id, ep.request_ids(), ep.max_new_tokens(), state=ep)
                            for ep, _ in active]
                for (episode, pager), completion in zip(active, engine.generate(requests)):
                    action = episode.on_completion(completion)
                    if action is not None:
                        episode.on_env_result(pager.step(action))
                for episode, _ in active:
                    if episode.done:
                        engine.release(episode.id)
                        bar.update()
                active = [g for g in active if not g[0].done]
                bar.set_postfix(turn=max((len(ep.traj.steps) for ep, _ in games), default=0))

    def _episode(self, spec: AgentSpec, store, max_steps: int, first: EnvResult, tag: str) -> Episode:
        _, renderers = self._engine_and_renderer()
        cfg = dataclasses.replace(self.cfg, env=dataclasses.replace(self.cfg.env, max_steps=max_steps))
        episode = Episode(tag, tag, renderers[spec.name], store, memory=cfg.memory, env=cfg.env, rollout=cfg.rollout,
                          agent=spec)
        episode.start(first)
        return episode

    # --- Memory API ---------------------------------------------------------------------------------
    def inserted(self) -> list[str]:
        block = self.meta.read("inserted")
        return json.loads(block.content) if block else []

    def insert(self, trajectory: dict) -> None:
        """Queue the trajectory; `flush` reads the queue in batches (the harness flushes after the last
        insert, and `query`/`save` flush first), so insertion order and keys are kept."""
        self._pending.append(trajectory)
        if len(self._pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        ids = self.inserted()
        games, scratches = [], []
        for n, trajectory in enumerate(self._pending):
            prefix = f"t{len(ids) + n:04d}"
            pager = TrajectoryPager(trajectory, self.per_chunk, self.max_chars)
            chunks = -(-len(trajectory["states"]) // self.per_chunk)
            scratches.append(InMemoryStore())
            episode = self._episode(self.read_spec, scratches[-1], chunks + TAIL_STEPS, pager.reset(),
                                    f"insert-{prefix}")
            games.append((episode, pager))
        self._play(games)
        with (self.dir / EPISODES_FILE).open("a") as log_file:
            for n, (trajectory, (episode, _), scratch) in enumerate(zip(self._pending, games, scratches)):
                self._archive(f"t{len(ids) + n:04d}", trajectory, scratch, len(ids) + n)
                # what the policy did, for inspection
                log_file.write(json.dumps({"trajectory_id": trajectory["id"], **episode.traj.to_json()}) + "\n")
                log.info("memex insert t%04d (%s): %d steps, %d blocks archived", len(ids) + n, trajectory["id"],
                         len(episode.traj.steps), len(scratch))
        ids += [t["id"] for t in self._pending]
        self.meta.write_many([BlockWrite("inserted", json.dumps(ids), "explicit")], step=0)
        self._pending = []

    def _archive(self, prefix: str, trajectory: dict, scratch: InMemoryStore, ordinal: int) -> None:
        """The blocks the policy archived while reading one trajectory, into the durable store under its prefix."""
        goal = str(trajectory.get("goal", ""))[:200]
        blocks = [BlockWrite(f"{prefix}-{b.index}"[:64], b.content, b.mode,
                             f"{b.description} (trajectory goal: {goal})".strip())
                  for b in (scratch.read(i) for i in scratch.indices())]
        if blocks:
            self.store.write_many(blocks, step=ordinal)

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        self.flush()
        shortlist = self.store.suggest(question, self.shortlist) or self.store.indices()[: self.shortlist]
        lines = [f"- {k}: {self.store.read(k).description or 'archived block'}" for k in shortlist]
        task = (f"Question: {question}\nArchived blocks that may hold the answer (db_index: what it holds):\n"
                + ("\n".join(lines) or "(the archive is empty)")
                + f"\nRead what you need (at most {self.max_reads} blocks), then call finish.")
        first = EnvResult("lme", task, 0.0, False, False, {"goal": question})
        episode = self._episode(self.query_spec, self.store, self.max_reads + 2, first, "query")
        engine, _ = self._engine_and_renderer()
        read: list[str] = []  # (one question at a time: the latency of query() is its own)
        while not episode.done and len(read) < self.max_reads:
            req = GenerationRequest(episode.id, episode.request_ids(), episode.max_new_tokens(), state=episode)
            episode.on_completion(engine.generate([req])[0])
            last = episode.traj.steps[-1] if episode.traj.steps else None
            if last is not None and last.tool == READ and last.error is None:
                key = last.arguments["db_index"]
                if key not in read:
                    read.append(key)
        engine.release(episode.id)
        return [{"type": "text", "value": f"[{k}] {self.store.read(k).description}\n{self.store.read(k).content}"}
                for k in read]

    def save(self, directory: Path) -> None:
        self.flush()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / STORE_FILE
        if target.resolve() == (self.dir / STORE_FILE).resolve():
            return
        with sqlite3.connect(self.dir / STORE_FILE) as src, sqlite3.connect(target) as dst:
            src.backup(dst)

    @classmethod
    def load(cls, directory: Path, options: MemoryOptions) -> MemexMemory:
        if not (Path(directory) / STORE_FILE).is_file():
            raise MemexError(f"no saved memex memory in {directory} ({STORE_FILE} missing): build it again")
        return cls(options, store_dir=Path(directory))

    def close(self) -> None:
        self.flush()
        self.store.close()
        self.meta.close()
