"""The batched runner over the env worker pool: same episodes as in-process, and a crashed env
worker ends only its own episode, as failed with the reason."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal

import pytest

from common.config import load_config
from envs.data import resolve_game
from envs.pool import EnvPool
from memory.parsing import render_tool_call
from rollout.runner import make_renderer, open_envs, run_episodes
from rollout.scripted import ScriptedEngine


def act(action):
    return render_tool_call("execute_action", {"action": action})


SCRIPT = [act("look"), act("inventory"), act("go to drawer 1"), act("open drawer 1"), act("inventory")]


@pytest.fixture(scope="module")
def setup(alfworld_data, smol_tokenizer):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=500"])
    games = [str(resolve_game(f"valid_unseen:{i}", alfworld_data)) for i in range(3)]
    return cfg, games, smol_tokenizer


@pytest.mark.slow
def test_pool_and_inline_give_the_same_trajectories(setup):
    cfg, games, tok = setup
    jobs = [(f"e{i}", g) for i, g in enumerate(games)]
    results = []
    for workers in (0, 2):
        engine = ScriptedEngine(tok, {eid: SCRIPT for eid, _ in jobs})
        with open_envs(cfg, workers) as envs:
            results.append([t.to_json() for t in run_episodes(jobs, engine, envs, make_renderer(tok, cfg), cfg)])
    assert results[0] == results[1]


class KillingEngine(ScriptedEngine):
    """A scripted policy that SIGKILLs the env worker of one episode before its third turn."""

    def __init__(self, tokenizer, scripts, pool, victim):
        super().__init__(tokenizer, scripts)
        self.pool, self.victim = pool, victim

    def generate(self, requests):
        if self.position.get(self.victim) == 2:
            os.kill(self.pool.worker_pid(self.victim), signal.SIGKILL)
        return super().generate(requests)


@pytest.mark.slow
def test_crashed_worker_fails_only_its_episode_with_reason(setup):
    cfg, games, tok = setup
    jobs = [("a", games[0]), ("b", games[1])]
    with EnvPool(2) as pool:
        engine = KillingEngine(tok, {"a": SCRIPT, "b": SCRIPT}, pool, victim="a")
        a, b = run_episodes(jobs, engine, pool, make_renderer(tok, cfg), cfg)
        assert a.end_reason == "crash" and a.crashed and not a.success and "died" in a.error
        assert a.to_json()["error"] == a.error
        assert a.reward == {}  # the agent loop never scores: the caller does, once (rewards.score_trajectories)
        assert b.end_reason == "script_exhausted" and len(b.steps) == len(SCRIPT)
        # The pool keeps serving new episodes afterwards.
        (again,) = run_episodes([("c", games[2])], ScriptedEngine(tok, {"c": SCRIPT[:1]}), pool,
                                make_renderer(tok, cfg), cfg)
        assert again.steps[0].observation.startswith("You are in the middle of a room")


def test_a_reply_cut_at_the_turn_limit_is_told_it_was_cut(setup):
    """A call cut at rollout.max_new_tokens is a format error whose observation says the reply hit the limit and
    to send a shorter call (a retry of the same call would be cut again); a short malformed call is not told so."""
    cfg, games, tok = setup
    cfg = load_config(None, [f"env.data_dir={cfg.env.data_dir}", "memory.threshold=500", "rollout.max_new_tokens=40"])
    long_call = render_tool_call("CompressExperience", {"summary": "Next: find the mug. " * 30, "db_blocks": []})
    script = [act("look"), long_call, '<tool_call>{"name": "execute_action"']
    engine = ScriptedEngine(tok, {"e0": script})
    with open_envs(cfg, 0) as envs:
        (traj,) = run_episodes([("e0", games[0])], engine, envs, make_renderer(tok, cfg), cfg)
    cut, short = traj.steps[1], traj.steps[2]
    assert cut.format_error and "cut at the turn's limit of 40 tokens" in cut.observation
    assert "send a shorter call" in cut.observation and "unclosed" in cut.observation
    assert short.format_error and "cut at" not in short.observation


class ConcurrentScripts(ScriptedEngine):
    """A scripted policy that takes concurrent requests, as a vLLM server does (`Engine.concurrent`). `hold`: the
    first reply of that episode waits (up to a minute) until another episode has asked for its last scripted turn;
    `order` records (episode, turn) as replies are sent; `fail`: the (episode, turn) whose request is refused."""

    concurrent = True

    def __init__(self, tokenizer, scripts, hold=None, fail=None):
        import threading

        super().__init__(tokenizer, scripts)
        self.hold, self.fail, self.order = hold, fail, []
        self.last_turn_asked = threading.Event()

    def generate(self, requests):
        (request,) = requests  # the runner sends each turn on its own
        episode, turn = request.episode_id, self.position.get(request.episode_id, 0)
        if episode != self.hold and turn == len(self.scripts[episode]) - 1:
            self.last_turn_asked.set()
        if episode == self.hold and turn == 0:
            self.last_turn_asked.wait(timeout=60)
        if (episode, turn) == self.fail:
            raise RuntimeError("the server refused this request")
        self.order.append((episode, turn))
        return super().generate(requests)


def test_episodes_in_flight_never_wait_for_each_other_and_play_the_same_turns(setup):
    """Without rollout.lockstep_turns, an engine that takes concurrent requests gets each episode's next turn as soon
    as its observation is back: a fast episode plays all its turns while a slow one is still on its first (in rounds
    it could not: the slow reply would wait the minute out), and every trajectory is the one the rounds give."""
    cfg, games, tok = setup
    jobs = [("slow", games[0]), ("fast", games[1])]
    scripts = {eid: SCRIPT for eid, _ in jobs}
    played = {}
    for lockstep in (True, False):
        c = load_config(None, [f"env.data_dir={cfg.env.data_dir}", "memory.threshold=500",
                               f"rollout.lockstep_turns={lockstep}"])
        engine = ConcurrentScripts(tok, scripts, hold=None if lockstep else "slow")
        with open_envs(c, 0) as envs:
            played[lockstep] = [t.to_json() for t in run_episodes(jobs, engine, envs, make_renderer(tok, c), c)]
        if lockstep:  # a round at a time: the fast episode's second turn comes after the slow one's first
            assert engine.order.index(("fast", 1)) > engine.order.index(("slow", 0))
        else:  # the slow reply was held until the fast episode asked for its last turn, and no longer
            assert engine.last_turn_asked.is_set()
            assert engine.order.index(("slow", 0)) > engine.order.index(("fast", len(SCRIPT) - 2))
    assert played[True] == played[False]


def test_a_refused_request_in_flight_ends_its_episode_only(setup):
    cfg, games, tok = setup
    c = load_config(None, [f"env.data_dir={cfg.env.data_dir}", "memory.threshold=500"])
    engine = ConcurrentScripts(tok, {"a": SCRIPT, "b": SCRIPT}, fail=("a", 1))
    with open_envs(c, 0) as envs:
        a, b = run_episodes([("a", games[0]), ("b", games[1])], engine, envs, make_renderer(tok, c), c)
    assert a.crashed and "the server refused this request" in a.error and len(a.steps) == 1
    assert b.end_reason == "script_exhausted" and len(b.steps) == len(SCRIPT)
