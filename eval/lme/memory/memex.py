"""`memex`: the Memex policy as the LME-V2 memory controller (the mission's last step).

The controller plays the reading task it is trained on (envs/reading.py, issue 27), split in two as the memory
API splits it, through the same agent loop (rollout/episode.py), system prompt, tools and context status:

Insert: each haystack trajectory is one reading episode of the reading env over that trajectory alone: every
`execute_action` (any action) shows the next `states_per_chunk` states (`State k` + thought + action + AXTree,
capped at `state_max_chars`); after the last page the agent archives and asks for the question, and the insert
episode ends there (the question comes at query time). What it archived with CompressExperience (anchor blocks
copied exactly from the AXTree text, explicit blocks it writes) goes into a durable SQLite experience store
(memory/store.py) under the index the policy gave it, `-2`, `-3`, ... when an earlier trajectory took that name,
as one reading episode's archive names them in training (`index_names: policy`, the default; `prefixed` keeps the
first controller's `t<NNNN>-<db_index>` of the trajectory's ordinal, which no training catalog shows: the reading
start at step 50 read `shopnova-products` where the catalog said `t0000-shopnova-products`, docs/results.md section 3),
described by the index-map line that named it, as a training catalog line is (`catalog_goal: true` appends the
trajectory's goal, which no training catalog shows; without it the catalog's first 3 blocks reach as much evidence or
more, `lme catalog-recall`, docs/results.md section 3): the catalog. What the policy did not archive, the memory does
not have.

Query: the question phase of the reading env: a fresh context holding the question and the catalog
(memory/catalog.py: a bm25 shortlist of `shortlist` lines, as a 500-trajectory catalog does not fit in a
prompt); the agent reads at most `max_reads` blocks with ReadExperience (the episode ends at finish, at the
read budget, or at the step limit; an execute_action gets the answer of the reading env after its question, NO_MORE_STATES: QueryPager). The blocks it read, in reading order, are the memory context. Any
checkpoint can be the controller (a reading-trained one, the ALFWorld GRPO one, a base model):
`extra["checkpoint"]`, run by the engine of `extra["config"]` (memexrl Config: transformers or vLLM, a managed
vLLM server included, eval.temperature: eval/engine.py), or `extra["engine"]`, an (engine, tokenizer) pair built by the caller. Other settings
(`--set key=value`): states_per_chunk (2), state_max_chars (2000), max_reads (3), shortlist (12),
page_end (""), index_names (policy), catalog_goal (false), insert_batch (rollout.batch_size: trajectories read together, one batched engine call per turn),
status_indices (catalog), workdir. `status_indices: catalog` (ours) names in a question episode's context status (and
in a missed read's error) only the blocks its catalog shows, while any archived block stays readable; `all` names
every archived block, as the paper's status does (memex.md "Context status"). A training task's archive is a few
trajectories' blocks (7 at a question of the GRPO run), all in its catalog; a haystack's is 50-100 (73 in one
held-out group), which put the status past the threshold after one read (docs/results.md section 3).
The page format (states_per_chunk, state_max_chars, page_end) defaults to that of the tasks the policy trained on,
the first task of the config's `train.reading_tasks` when that file is here (`training_page_format`), so a
controller pages the haystack as it learned to without `--set`; `--set` wins.

Save/load: the SQLite file is the memory; `save` copies it (sqlite backup API) and `load`
reopens it, so insert -> close -> reopen -> query gives the same context (greedy decoding). A loaded memory writes
its work files (the question episodes' log, a managed server's merged checkpoint) to `workdir`, not into the saved
directory, and `warm_up` starts its engine before the first timed query.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sqlite3
from pathlib import Path

from tqdm import tqdm

from common.config import Config, load_config
from common.engine import GenerationRequest
from common.errors import MemexError
from common.trajectory import READING_TASK
from envs.data import read_games_file, reading_task_files
from envs.lme_records import unique_index
from envs.pool import EnvResult
from envs.reading import READING_KIND, ReadingEnv, load_reading_task
from eval.lme.memory.base import Memory, MemoryOptions, register
from memory.catalog import catalog_indices, render_catalog, what_it_holds
from memory.parsing import READ
from memory.store import BlockWrite, InMemoryStore, SQLiteStore
from rollout.episode import Episode
from rollout.runner import generate_each, make_renderer
from rollout.strategies import AgentSpec
from training.policy import resolve_checkpoint

log = logging.getLogger(__name__)

STORE_FILE = "memex_store.sqlite"
EPISODES_FILE = "insert_episodes.jsonl"  # the reading episodes (trajectory JSON), one line per trajectory
QUERY_EPISODES_FILE = "query_episodes.jsonl"  # the question episodes (trajectory JSON), one line per query
TAIL_STEPS = 3  # turns after the last chunk to archive and finish
BLOCKS, META = "lme", "lme-meta"  # store namespaces: the archived blocks; the inserted trajectory ids
READ_DONE = "The trajectory is read: its archive is kept for the questions."


def insert_task(trajectory: dict, per_chunk: int, max_chars: int, max_reads: int, shortlist: int,
                page_end: str = "") -> dict:
    """The reading task of one haystack trajectory (no question yet: it comes at query time)."""
    return {"kind": READING_KIND, "id": str(trajectory.get("id", "")), "question": "", "question_type": "",
            "trajectories": [trajectory], "evidence": [], "states_per_page": per_chunk, "state_max_chars": max_chars,
            "max_reads": max_reads, "shortlist": shortlist, "page_end": page_end}


def training_page_format(cfg: Config) -> dict:
    """states_per_chunk, state_max_chars and page_end of the first task in `cfg.train.reading_tasks` (the pages
    `lme tasks` made for the policy's training, e.g. the page end line its anchor blocks end at), or {} when the
    config names no reading tasks or they are not on this machine (the controller's own defaults then)."""
    files = reading_task_files(cfg.train.reading_tasks)
    first = files[0] if files else ""
    if not first or not Path(first).expanduser().is_file():
        return {}
    try:
        games = read_games_file(first)
        if not games:
            return {}
        task = load_reading_task(games[0])
    except MemexError as e:
        log.warning("memex: the page format of train.reading_tasks is not read (%s); the defaults are used", e)
        return {}
    found = {"states_per_chunk": task["states_per_page"], "state_max_chars": task["state_max_chars"],
             "page_end": task.get("page_end", "")}
    log.info("memex: pages as the training tasks (%s): %s", first, found)
    return found


class InsertPager:
    """The reading env over one trajectory, ended where it would ask the question (EnvResult answers)."""

    def __init__(self, task: dict):
        self.env = ReadingEnv(task)

    def reset(self) -> EnvResult:
        obs, info = self.env.reset()
        return EnvResult("lme", obs, 0.0, False, False, info)

    def step(self, action: str) -> EnvResult:
        obs, _, _, _, info = self.env.step(action)
        if info.get("new_context"):  # the question: not at insert time
            return EnvResult("lme", READ_DONE, 0.0, True, False, {})
        return EnvResult("lme", obs, 0.0, False, False, info)


class QueryPager:
    """The reading env over no trajectory, its question asked: the query phase's env. `question` is the env's
    question message (the catalog follows it); every execute_action after it gets the env's own answer
    (NO_MORE_STATES), as in training -- left unanswered, the call sat in the context with no reply and the policy
    wrote empty turns after it (docs/results.md section 3)."""

    def __init__(self, question: str, max_reads: int, shortlist: int):
        task = {**insert_task({}, 1, 1, max_reads, shortlist), "question": question, "trajectories": []}
        self.env = ReadingEnv(task)
        self.env.reset()
        self.question, _, _, _, _ = self.env.step("next")  # no pages: the first step asks

    def step(self, action: str) -> EnvResult:
        obs, _, _, _, info = self.env.step(action)
        return EnvResult("lme", obs, 0.0, False, False, info)


class StatusShowsCatalog:
    """The archive as a question episode sees it with `status_indices: catalog`: every block readable (and
    writable), but `indices()`, what the context status and a missed read's error list as available, is the
    question's catalog shortlist alone."""

    def __init__(self, store: SQLiteStore, shown: list[str]):
        self.store, self.shown = store, list(shown)

    def indices(self) -> list[str]:
        return list(self.shown)

    def __len__(self) -> int:
        return len(self.store)

    def __contains__(self, index: object) -> bool:
        return index in self.store

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@register
class MemexMemory(Memory):
    """The trained policy archives trajectories at insert and reads its archive back at query."""

    name = "memex"

    def __init__(self, options: MemoryOptions, store_dir: Path | None = None):
        super().__init__(options)
        self.cfg: Config = options.extra.get("config") or load_config(None, [])
        x = {**training_page_format(self.cfg), **options.extra}
        self.checkpoint = resolve_checkpoint(str(x.get("checkpoint") or self.cfg.model.name), "--checkpoint")
        self.per_chunk = int(x.get("states_per_chunk", 2))
        self.max_chars = int(x.get("state_max_chars", 2000))
        self.max_reads = int(x.get("max_reads", 3))
        self.shortlist = int(x.get("shortlist", 12))
        self.page_end = str(x.get("page_end", ""))  # the training tasks' `lme tasks --page-end`
        self.index_names = str(x.get("index_names", "policy"))
        if self.index_names not in ("policy", "prefixed"):
            raise MemexError(f"memex: index_names must be 'policy' or 'prefixed', got {self.index_names!r}")
        self.status_indices = str(x.get("status_indices", "catalog"))
        if self.status_indices not in ("catalog", "all"):
            raise MemexError(f"memex: status_indices must be 'catalog' or 'all', got {self.status_indices!r}")
        self.catalog_goal = x.get("catalog_goal", False)
        if not isinstance(self.catalog_goal, bool):
            raise MemexError(f"memex: catalog_goal must be true or false, got {self.catalog_goal!r}")
        # the work files (episode logs, a managed server's merged checkpoint and log) go to the workdir, also for a
        # memory loaded from a saved directory, which keeps the store alone
        self.dir = Path(x.get("workdir") or store_dir or "runs/lme-memex")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store_path = Path(store_dir or self.dir) / STORE_FILE
        self.store = SQLiteStore(self.store_path, BLOCKS)
        self.meta = SQLiteStore(self.store_path, META)
        self._engine = None
        self._resources = contextlib.ExitStack()  # a managed vLLM server (rollout.vllm_server_url=managed) until close
        self._pending: list[dict] = []  # inserted, not read yet (flush reads them in one batch)
        self.batch = int(x.get("insert_batch", self.cfg.rollout.batch_size))
        self.spec = AgentSpec("memex-reader")  # the memex agent; its episodes say they are reading tasks

    # --- the policy -------------------------------------------------------------------------------
    def _engine_and_renderer(self):
        if self._engine is None:
            from eval.engine import make_eval_engine

            given = self.options.extra.get("engine")  # (engine, tokenizer) already built, e.g. a ScriptedEngine
            engine, tokenizer = given or make_eval_engine(self.cfg, self.checkpoint, self.dir, self._resources)
            self._engine = (engine, make_renderer(tokenizer, self.cfg, self.spec))
        return self._engine

    def _play(self, games: list[tuple[Episode, InsertPager]]) -> None:
        """Drive episodes to their ends together: one engine call per turn for all that still run (the
        engine batches them: rollout.batch_size), each env answer from its own pager."""
        engine, _ = self._engine_and_renderer()
        active = list(games)
        with tqdm(total=len(games), desc="memex reads trajectories", unit="traj", leave=False) as bar:
            while active:
                requests = [GenerationRequest(ep.id, ep.request_ids(), ep.max_new_tokens(), state=ep)
                            for ep, _ in active]
                for (episode, pager), completion in zip(active, generate_each(engine, requests)):
                    if isinstance(completion, str):  # the engine failed on this request: the episode, not the run
                        log.warning("memex: %s ends on an engine fault: %s", episode.id, completion)
                        episode.crash(completion)
                        continue
                    action = episode.on_completion(completion)
                    if action is not None:
                        episode.on_env_result(pager.step(action))
                for episode, _ in active:
                    if episode.done:
                        engine.release(episode.id)
                        bar.update()
                active = [g for g in active if not g[0].done]
                bar.set_postfix(turn=max((len(ep.traj.steps) for ep, _ in games), default=0))
        if games and all(ep.traj.crashed for ep, _ in games):  # a fault of the engine's, not one request's
            raise MemexError(f"every memex episode of this batch of {len(games)} trajectories crashed; the first: "
                             f"{games[0][0].traj.error}")

    def _episode(self, store, max_steps: int, first: EnvResult, tag: str) -> Episode:
        _, renderer = self._engine_and_renderer()
        cfg = dataclasses.replace(self.cfg, env=dataclasses.replace(self.cfg.env, max_steps=max_steps))
        episode = Episode(tag, tag, renderer, store, memory=cfg.memory, env=cfg.env, rollout=cfg.rollout,
                          agent=self.spec)
        episode.start(first)
        return episode

    # --- Memory API ---------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """The policy's engine (a managed vLLM server: minutes on a CPU) started before the first timed query."""
        self._engine_and_renderer()

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
        pending, self._pending = self._pending, []  # a batch that fails is not read again (by close)
        if not pending:
            return
        ids = self.inserted()
        games, scratches = [], []
        for n, trajectory in enumerate(pending):
            prefix = f"t{len(ids) + n:04d}"
            pager = InsertPager(insert_task(trajectory, self.per_chunk, self.max_chars, self.max_reads, self.shortlist,
                                            self.page_end))
            scratches.append(InMemoryStore())
            episode = self._episode(scratches[-1], len(pager.env.pages) + TAIL_STEPS, pager.reset(), f"insert-{prefix}")
            games.append((episode, pager))
        self._play(games)
        taken = set(self.store.indices())  # the names stored so far; each trajectory's blocks add theirs
        with (self.dir / EPISODES_FILE).open("a") as log_file:
            for n, (trajectory, (episode, _), scratch) in enumerate(zip(pending, games, scratches)):
                self._archive(trajectory, scratch, len(ids) + n, taken)
                # what the policy did, for inspection
                log_file.write(json.dumps({"trajectory_id": trajectory["id"], **episode.traj.to_json()}) + "\n")
                log.info("memex insert t%04d (%s): %d steps, %d blocks archived", len(ids) + n, trajectory["id"],
                         len(episode.traj.steps), len(scratch))
        ids += [t["id"] for t in pending]
        self.meta.write_many([BlockWrite("inserted", json.dumps(ids), "explicit")], step=0)

    def _archive(self, trajectory: dict, scratch: InMemoryStore, ordinal: int, taken: set[str]) -> None:
        """The blocks the policy archived while reading the `ordinal`-th trajectory, into the durable store (see
        index_names); `taken`, the names already stored, gets theirs."""
        goal = f" (trajectory goal: {str(trajectory.get('goal', ''))[:200]})" if self.catalog_goal else ""
        blocks = []
        for b in (scratch.read(i) for i in scratch.indices()):
            name = f"t{ordinal:04d}-{b.index}"[:64] if self.index_names == "prefixed" else unique_index(b.index[:60], taken)
            taken.add(name)
            blocks.append(BlockWrite(name, b.content, b.mode, what_it_holds(b.index, b.description) + goal))
        if blocks:
            self.store.write_many(blocks, step=ordinal)

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        self.flush()
        shown = catalog_indices(self.store, question, self.shortlist, self.cfg.memory.catalog_rank_chars)
        pager = QueryPager(question, self.max_reads, self.shortlist)
        first = EnvResult("lme", pager.question + "\n" + render_catalog(self.store, shown), 0.0, False, False,
                          {"goal": question, "task": {"kind": READING_TASK}})
        store = self.store if self.status_indices == "all" else StatusShowsCatalog(self.store, shown)
        episode = self._episode(store, self.max_reads + 2, first, "query")
        engine, _ = self._engine_and_renderer()
        read: list[str] = []  # (one question at a time: the latency of query() is its own)
        while not episode.done and len(read) < self.max_reads:
            req = GenerationRequest(episode.id, episode.request_ids(), episode.max_new_tokens(), state=episode)
            (completion,) = generate_each(engine, [req])
            if isinstance(completion, str):  # the engine failed: this question reads what it has read so far
                log.warning("memex: a question's episode ends on an engine fault: %s", completion)
                episode.crash(completion)
                break
            action = episode.on_completion(completion)
            if action is not None:  # an env action
                episode.on_env_result(pager.step(action))
            last = episode.traj.steps[-1] if episode.traj.steps else None
            if last is not None and last.tool == READ and last.error is None:
                key = last.arguments["db_index"]
                if key not in read:
                    read.append(key)
        engine.release(episode.id)
        with (self.dir / QUERY_EPISODES_FILE).open("a") as log_file:  # what the policy did, for inspection
            log_file.write(json.dumps({"question": question, "read": read, **episode.traj.to_json()}) + "\n")
        return [{"type": "text", "value": f"[{k}] {self.store.read(k).description}\n{self.store.read(k).content}"}
                for k in read]

    def save(self, directory: Path) -> None:
        self.flush()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / STORE_FILE
        if target.resolve() == self.store_path.resolve():
            return
        with sqlite3.connect(self.store_path) as src, sqlite3.connect(target) as dst:
            src.backup(dst)

    @classmethod
    def load(cls, directory: Path, options: MemoryOptions) -> MemexMemory:
        if not (Path(directory) / STORE_FILE).is_file():
            raise MemexError(f"no saved memex memory in {directory} ({STORE_FILE} missing): build it again")
        return cls(options, store_dir=Path(directory))

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.store.close()
            self.meta.close()
            self._resources.close()
