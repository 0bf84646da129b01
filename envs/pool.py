"""A pool of worker processes hosting envs (ModifiedAlfWorld, paper section 6.2; reading tasks), driven by messages.

TextWorld's PDDL parser is not thread-safe and one env step costs ~20-40 ms of pure Python
(alfworld.md), so envs live in N worker processes, started with "spawn" because the parent may
hold torch/CUDA. A worker hosts the envs of every episode assigned to it and plays their
requests one at a time (envs in one process are independent: each owns a fast-downward library
copy and its own `random` stream). Episodes go to the least loaded worker.

Failures never hang, never drop a request and never kill the run:
- an ordinary exception inside one env answers `crashed=True` (with the exception's last
  traceback line) for that episode only; the worker and its other episodes go on;
- a worker that dies (killed, segfault) or does not answer within `timeout` seconds is killed
  and restarted; each episode it hosted is lost: its pending request answers `crashed=True,
  terminated=True` with the reason, and so does every later step of it.
A crashed episode can be reset again (it then starts afresh on a live worker).

As with any "spawn" multiprocessing, a script that builds a pool must do so under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class EnvResult:
    """One reset or step answer (gymnasium's tuple plus the episode id and the crash report)."""

    episode_id: str
    obs: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict
    crashed: bool = False
    error: str | None = None  # why, when crashed


def _crashed(episode_id: str, error: str) -> EnvResult:
    return EnvResult(episode_id, "", 0.0, True, False, {}, crashed=True, error=error)


# --------------------------------------------------------------------------------- worker side
def _last_line(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else repr(exc)


def _serve(op: str, episode_id: str, arg: Any, envs: dict[str, Any], env_kwargs: dict) -> EnvResult:
    from envs.games import open_env

    try:
        if op == "warm":  # import textworld/alfworld now rather than during the first reset
            from envs.alfworld import preload

            preload()
            return EnvResult(episode_id, "", 0.0, False, False, {})
        if op == "reset":
            old = envs.pop(episode_id, None)
            if old is not None:
                old.close()
            env = open_env(arg, **env_kwargs)
            envs[episode_id] = env
            obs, info = env.reset()
            return EnvResult(episode_id, obs, 0.0, False, False, info)
        env = envs.get(episode_id)
        if env is None:
            return _crashed(episode_id, f"episode {episode_id!r} is not open on its worker: reset it first")
        obs, reward, terminated, truncated, info = env.step(arg)
        return EnvResult(episode_id, obs, reward, terminated, truncated, info)
    except Exception as e:  # one broken episode must not take the worker down
        env = envs.pop(episode_id, None)
        if env is not None:
            try:
                env.close()
            except Exception:  # the env is already broken: nothing more to save
                pass
        logger.warning("episode %s crashed during %s %r: %s", episode_id, op, arg, _last_line(e))
        return _crashed(episode_id, _last_line(e))


def _worker_main(conn: Connection, env_kwargs: dict) -> None:
    """A worker's loop: ("batch", [(op, episode_id, arg), ...]) -> one EnvResult per request, in order;
    ("close", episode_id) and ("stop",) answer nothing.

    SIGUSR1 is ignored: it is the preemption notice meant for the trainer (common/preemption.py), and a
    scheduler that signals every process of a job (SLURM's --signal without B:) would otherwise end the
    workers mid-episode, before the trainer's last step ends."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    envs: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            break
        if msg[0] == "stop":
            break
        if msg[0] == "close":
            env = envs.pop(msg[1], None)
            if env is not None:
                env.close()
            continue
        for op, episode_id, arg in msg[1]:
            conn.send(_serve(op, episode_id, arg, envs, env_kwargs))
    for env in envs.values():
        env.close()


# --------------------------------------------------------------------------------- parent side
@dataclass
class _Worker:
    index: int
    process: Any
    conn: Connection
    episodes: set[str] = field(default_factory=set)


class EnvPool:
    """N worker processes hosting ModifiedAlfWorld envs; see the module docstring.

    Workers start on first use (or at `warm_up()`), with PYTHONHASHSEED=`hash_seed` (None: inherit)
    so that the handcoded expert's plans are reproducible. `timeout` bounds the wait for any one answer (a reset loads a
    game in ~1 s, a step takes ~40 ms), so a hung worker is detected, killed and restarted.
    """

    def __init__(
        self,
        num_workers: int = 2,
        env_kwargs: dict | None = None,
        *,
        timeout: float = 120.0,
        start_method: str = "spawn",
        hash_seed: int | None = 0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.env_kwargs = dict(env_kwargs or {})
        self.timeout = timeout
        self.hash_seed = hash_seed
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker | None] = [None] * num_workers
        self._home: dict[str, int] = {}  # episode id -> worker index
        self._lost: dict[str, str] = {}  # episode id -> why it crashed (answered to later steps)
        self._closed = False

    # ----------------------------------------------------------------------------- workers
    def _start(self, index: int) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn, self.env_kwargs), name=f"memexrl-env-{index}", daemon=True
        )
        # The handcoded expert iterates over sets of facts (pick_two tasks), so its plan depends on
        # Python's string hashing: a fixed PYTHONHASHSEED in the workers makes it reproducible.
        saved = os.environ.get("PYTHONHASHSEED")
        if self.hash_seed is not None:
            os.environ["PYTHONHASHSEED"] = str(self.hash_seed)
        try:
            process.start()
        finally:
            if saved is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = saved
        child_conn.close()
        worker = _Worker(index, process, parent_conn)
        self._workers[index] = worker
        logger.debug("env worker %d started (pid %d)", index, process.pid)
        return worker

    def _worker(self, index: int) -> _Worker:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        worker = self._workers[index]
        return worker if worker is not None else self._start(index)

    def _fail(self, worker: _Worker, reason: str) -> None:
        """Kill and forget a dead or hung worker; all its episodes are lost with `reason`."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
        for episode_id in worker.episodes:
            self._lost[episode_id] = reason
            self._home.pop(episode_id, None)
        logger.warning("%s; %d episode(s) lost, restarting the worker", reason, len(worker.episodes))
        self._workers[worker.index] = None
        if not self._closed:
            self._start(worker.index)

    def worker_pid(self, episode_id: str) -> int | None:
        """The pid of the process hosting an episode (for monitoring and tests)."""
        index = self._home.get(episode_id)
        worker = self._workers[index] if index is not None else None
        return worker.process.pid if worker is not None else None

    def lost_episodes(self) -> dict[str, str]:
        """Episodes lost to a crash and not reset or closed since: id -> reason."""
        return dict(self._lost)

    # ----------------------------------------------------------------------------- requests
    def _run(self, requests: list[tuple[str, str, Any]]) -> list[EnvResult]:
        """Send (op, episode_id, arg) requests to their workers at once; answers in request order."""
        results: list[EnvResult | None] = [None] * len(requests)
        pending: dict[int, deque[tuple[int, str, str, Any]]] = {}
        for i, (op, episode_id, arg) in enumerate(requests):
            if episode_id in self._lost:
                results[i] = _crashed(episode_id, self._lost[episode_id])
            elif episode_id not in self._home:
                results[i] = _crashed(episode_id, f"unknown episode {episode_id!r}: reset it first")
            else:
                pending.setdefault(self._home[episode_id], deque()).append((i, op, episode_id, arg))

        workers: dict[int, _Worker] = {}
        for index, queue in list(pending.items()):
            worker = self._worker(index)
            try:
                worker.conn.send(("batch", [(op, eid, arg) for _, op, eid, arg in queue]))
                workers[index] = worker
            except (OSError, ValueError):  # broken pipe: it died while idle
                self._settle(worker, queue, results, self._death(worker, queue))
                del pending[index]

        deadline = {index: time.monotonic() + self.timeout for index in pending}
        while pending:
            by_handle: dict[Any, int] = {}
            for index in pending:
                by_handle[workers[index].conn] = index
                by_handle[workers[index].process.sentinel] = index
            wait_s = max(0.0, min(deadline[index] for index in pending) - time.monotonic())
            ready = wait(list(by_handle), timeout=wait_s)
            for index in sorted({by_handle[h] for h in ready}):
                if index not in pending:
                    continue
                worker, queue = workers[index], pending[index]
                dead = False
                try:
                    while queue and worker.conn.poll():
                        answer: EnvResult = worker.conn.recv()
                        i = queue.popleft()[0]
                        results[i] = self._record(index, answer)
                        deadline[index] = time.monotonic() + self.timeout
                except (EOFError, OSError):  # the pipe closed: the worker is gone
                    dead = True
                if queue and (dead or not worker.process.is_alive()):
                    self._settle(worker, queue, results, self._death(worker, queue))
                if not queue:
                    del pending[index]
            now = time.monotonic()
            for index in [j for j in pending if deadline[j] <= now]:
                queue = pending.pop(index)
                i, op, episode_id, arg = queue[0]
                reason = (
                    f"env worker {index} did not answer within {self.timeout:g} s during {op} {arg!r} "
                    f"of episode {episode_id!r} (killed and restarted)"
                )
                self._settle(workers[index], queue, results, reason)
        return [
            r if r is not None else _crashed(requests[i][1], "internal error: the pool lost this request")
            for i, r in enumerate(results)
        ]

    def _death(self, worker: _Worker, queue: deque[tuple[int, str, str, Any]]) -> str:
        worker.process.join(timeout=5)
        _, op, episode_id, arg = queue[0]
        code = worker.process.exitcode
        return (
            f"env worker {worker.index} died (exit code {code}) during {op} {arg!r} of episode {episode_id!r}"
        )

    def _settle(
        self, worker: _Worker, queue: deque[tuple[int, str, str, Any]], results: list, reason: str
    ) -> None:
        """Answer every unanswered request of a failed worker with `reason`, then restart it."""
        self._fail(worker, reason)
        for i, _, episode_id, _ in queue:
            results[i] = _crashed(episode_id, reason)
        queue.clear()

    def _record(self, index: int, answer: EnvResult) -> EnvResult:
        if answer.crashed:  # the episode's env is gone from its worker
            self._lost[answer.episode_id] = answer.error or "crashed"
            self._home.pop(answer.episode_id, None)
            worker = self._workers[index]
            if worker is not None:
                worker.episodes.discard(answer.episode_id)
        return answer

    # ----------------------------------------------------------------------------- public API
    def reset_many(self, requests: list[tuple[str, str]]) -> list[EnvResult]:
        """Start episodes: (episode_id, game_file) pairs, spread over the workers, played in parallel.

        A known episode id restarts on its worker (with the new game); a new one (or one lost to
        a crash) goes to the least loaded worker.
        """
        for episode_id, _ in requests:
            self._lost.pop(episode_id, None)
            if episode_id not in self._home:
                loads = [len(w.episodes) if w is not None else 0 for w in self._workers]
                index = min(range(self.num_workers), key=lambda j: loads[j])
                self._worker(index).episodes.add(episode_id)
                self._home[episode_id] = index
        return self._run([("reset", episode_id, str(game)) for episode_id, game in requests])

    def warm_up(self) -> None:
        """Start every worker and import ALFWorld in it (~2 s), off the first reset's clock."""
        ids = [f"__warm_up_{index}__" for index in range(self.num_workers)]
        for index, warm_id in enumerate(ids):
            self._worker(index)
            self._home[warm_id] = index
        try:
            for result in self._run([("warm", warm_id, None) for warm_id in ids]):
                if result.crashed:
                    raise RuntimeError(f"env worker failed to start: {result.error}")
        finally:
            for warm_id in ids:
                self._home.pop(warm_id, None)
                self._lost.pop(warm_id, None)

    def step_many(self, requests: list[tuple[str, str]]) -> list[EnvResult]:
        """Play (episode_id, action) pairs, in parallel across workers; results in request order."""
        return self._run([("step", episode_id, action) for episode_id, action in requests])

    def close_episode(self, episode_id: str) -> None:
        """Free an episode's env (a no-op for unknown or lost episodes)."""
        self._lost.pop(episode_id, None)
        index = self._home.pop(episode_id, None)
        worker = self._workers[index] if index is not None else None
        if worker is None:
            return
        worker.episodes.discard(episode_id)
        try:
            worker.conn.send(("close", episode_id))
        except (OSError, ValueError):  # it died: the next request to it will notice
            pass

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        self._closed = True
        for worker in self._workers:
            if worker is None:
                continue
            try:
                worker.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            if worker is None:
                continue
            worker.process.join(timeout=10)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.conn.close()
        self._workers = [None] * self.num_workers
        self._home.clear()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown: the daemon workers die with us anyway
                pass
