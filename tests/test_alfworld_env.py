"""The modified ALFWorld env (paper section 6.2), its data helpers, the env pool and the env bench.

Real ALFWorld games throughout (no mocks); the data comes from the `alfworld_data` fixture.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import io  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from common.errors import MemexError  # noqa: E402
from envs.alfworld import (  # noqa: E402
    EPISODE_OVER,
    LOOK_REFUSAL,
    ROOM_PREFIX,
    ModifiedAlfWorld,
    is_state_changing,
)
from envs.data import (  # noqa: E402
    SPLITS,
    TASK_TYPES,
    data_root,
    list_games,
    prepare_alfworld,
    resolve_game,
    task_type_of,
)
from envs.pool import EnvPool  # noqa: E402

# A valid_seen game the handcoded expert wins in 15 steps while issuing `look` twice: the modified
# env plays the second one silently (the expert's bookkeeping needs it) and offers the next action.
EXPERT_GAME = "valid_seen:33"


def play_expert(env: ModifiedAlfWorld, max_steps: int = 50) -> tuple[list[str], list[str], dict]:
    """Play the handcoded expert's actions; return (actions, observations, last info)."""
    obs, info = env.reset()
    actions, observations = [], [obs]
    for _ in range(max_steps):
        action = (info["expert_plan"] or ["look"])[0]
        obs, reward, terminated, truncated, info = env.step(action)
        actions.append(action)
        observations.append(obs)
        assert truncated is False
        assert reward == (1.0 if terminated else 0.0)
        if terminated:
            break
    return actions, observations, info


# ----------------------------------------------------------------------------- envs/data.py
def test_split_counts(alfworld_data):
    counts = {split: len(list_games(split, alfworld_data)) for split in SPLITS}
    assert counts == {"train": 3553, "valid_seen": 140, "valid_unseen": 134}
    valid = list_games("valid", alfworld_data)
    assert valid == list_games("valid_seen", alfworld_data) + list_games("valid_unseen", alfworld_data)
    assert all(list_games(s, alfworld_data) == sorted(list_games(s, alfworld_data)) for s in SPLITS)
    assert all(p.name == "game.tw-pddl" for p in valid)
    assert {task_type_of(p) for p in valid} == set(TASK_TYPES)


def test_resolve_game_forms(alfworld_data):
    game = list_games("valid_seen", alfworld_data)[3]
    assert resolve_game("valid_seen:3", alfworld_data) == game
    assert resolve_game(str(game), alfworld_data) == game
    assert resolve_game(str(game.parent), alfworld_data) == game
    assert resolve_game("valid:140", alfworld_data) == list_games("valid_unseen", alfworld_data)[0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("valid_seen:140", "use 0..139"),
        ("train:-1", "out of range"),
        ("bogus:0", "unknown ALFWorld split"),
        ("train:x", "INDEX must be an integer"),
        ("/no/such/game", "no ALFWorld game"),
    ],
)
def test_resolve_game_errors(alfworld_data, spec, message):
    with pytest.raises(MemexError, match=message):
        resolve_game(spec, alfworld_data)


def test_data_root_errors_and_default_dest(tmp_path, monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MemexError, match="memexrl data alfworld"):
        data_root()
    with pytest.raises(MemexError, match=f"ALFWorld data not found at {tmp_path}"):
        data_root(str(tmp_path))
    (tmp_path / "data" / "alfworld" / "json_2.1.1").mkdir(parents=True)  # where `memexrl data alfworld` unpacks
    assert data_root() == Path("data/alfworld")


def _tar(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    return path


def test_prepare_alfworld_unpacks_once(tmp_path, alfworld_data):
    names = [f"json_2.1.1/{s}/task-1/trial_1/game.tw-pddl" for s in SPLITS] + ["logic/alfred.pddl"]
    archive = _tar(tmp_path / "mini.tar.gz", names)
    dest = tmp_path / "data"
    assert prepare_alfworld(dest, archive) == dest.resolve()
    assert (dest / "json_2.1.1" / "valid_seen" / "task-1" / "trial_1" / "game.tw-pddl").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".data-unpack-")]  # temp dir gone
    # Idempotent: a prepared dest is left alone, even when the archive is gone.
    archive.unlink()
    assert prepare_alfworld(dest, archive) == dest.resolve()
    assert prepare_alfworld(alfworld_data) == Path(alfworld_data).resolve()


@pytest.mark.parametrize("bad", ["../evil.txt", "/tmp/evil.txt", "json_2.1.1/../../evil.txt"])
def test_prepare_alfworld_rejects_unsafe_members(tmp_path, bad):
    archive = _tar(tmp_path / "bad.tar.gz", ["json_2.1.1/train/x", bad])
    with pytest.raises(MemexError, match="unsafe path"):
        prepare_alfworld(tmp_path / "data", archive)
    assert not (tmp_path / "data").exists()
    assert not (tmp_path.parent / "evil.txt").exists()


def test_prepare_alfworld_rejects_foreign_archive(tmp_path):
    archive = _tar(tmp_path / "other.tar.gz", ["something/else.txt"])
    with pytest.raises(MemexError, match="not the ALFWorld json_2.1.1 archive"):
        prepare_alfworld(tmp_path / "data", archive)
    with pytest.raises(MemexError, match="archive not found"):
        prepare_alfworld(tmp_path / "data", tmp_path / "missing.tar.gz")


# ----------------------------------------------------------------------------- envs/alfworld.py
@pytest.mark.parametrize(
    "action, changes",
    [
        ("pick up apple 1", True),
        ("take apple 1 from countertop 1", True),
        ("put apple 1 in/on fridge 1", True),
        ("move apple 1 to fridge 1", True),
        ("open fridge 1", True),
        ("close fridge 1", True),
        ("use desklamp 1", True),
        ("clean apple 1 with sinkbasin 1", True),
        ("heat apple 1 with microwave 1", True),
        ("cool apple 1 with fridge 1", True),
        ("slice apple 1 with knife 1", True),
        ("toggle desklamp 1", True),
        ("  Open   Fridge 1 ", True),
        ("go to fridge 1", False),
        ("examine fridge 1", False),
        ("look", False),
        ("inventory", False),
        ("help", False),
        ("opening fridge", False),
        ("", False),
    ],
)
def test_is_state_changing(action, changes):
    assert is_state_changing(action) is changes


def test_bad_game_path(tmp_path):
    with pytest.raises(MemexError, match="no ALFWorld game"):
        ModifiedAlfWorld(tmp_path / "nope" / "game.tw-pddl")


def test_corrupt_game_file(tmp_path):
    (tmp_path / "game.tw-pddl").write_text("not json")
    (tmp_path / "traj_data.json").write_text("{}")
    with pytest.raises(MemexError, match="cannot load ALFWorld game"):
        ModifiedAlfWorld(tmp_path).reset()


def test_constructor_is_cheap(alfworld_data):
    env = ModifiedAlfWorld(list_games("valid_seen", alfworld_data)[0])
    assert env._env is None  # nothing loaded before reset()
    with pytest.raises(MemexError, match="call reset"):
        env.step("look")


def test_modified_mode_look_once(alfworld_data):
    game = list_games("valid_seen", alfworld_data)[5]
    with ModifiedAlfWorld(game) as env:
        obs, info = env.reset()
        assert obs.startswith("Your task is to: ")
        assert ROOM_PREFIX not in obs and "Welcome" not in obs and "Admissible" not in obs
        assert info["goal"] and obs == f"Your task is to: {info['goal']}"
        assert info["game"] == str(game) and info["task_type"] == task_type_of(game)
        assert info["won"] is False and info["look"] is None
        assert "look" in info["admissible_commands"] and info["expert_plan"] == ["look"]

        obs, reward, terminated, truncated, info = env.step("look")
        assert obs.startswith("You are in the middle of a room. Looking quickly around you, you see a ")
        assert "nothing" not in obs and info["look"] == "first" and info["state_changing"] is False
        assert (reward, terminated, truncated) == (0.0, False, False)
        room = obs

        go = next(a for a in info["admissible_commands"] if a.startswith("go to "))
        obs, *_, info = env.step(go)
        assert obs.startswith("You arrive at") and info["look"] is None
        assert go.removeprefix("go to ") in room  # the overview listed the receptacle

        for spelling in ("look", "  LOOK "):
            obs, reward, terminated, _, info = env.step(spelling)
            assert obs == LOOK_REFUSAL and "ReadExperience" in obs
            assert info["look"] == "refused" and not terminated

        # A new episode gets its one look back.
        obs, _ = env.reset()
        assert env.step("look")[0] == room


def test_standard_mode(alfworld_data):
    game = list_games("valid_seen", alfworld_data)[5]
    env = ModifiedAlfWorld(game, hide_admissible=False, hide_initial_room=False, look_once=False)
    obs, info = env.reset()
    room, rest = obs.split("\n\n", 1)
    assert room.startswith(ROOM_PREFIX) and "nothing" not in room
    task, admissible = rest.split("\nAdmissible actions: ")
    assert task == f"Your task is to: {info['goal']}"
    assert admissible.split(", ") == info["admissible_commands"]
    for _ in range(3):  # look is never refused; it answers the env's own text
        obs, *_, info = env.step("look")
        assert obs.startswith("You are in the middle of a room. Looking quickly around you, you see nothing.")
        assert obs.endswith(", ".join(info["admissible_commands"]))
    env.close()


def test_look_once_off_in_modified_mode(alfworld_data):
    env = ModifiedAlfWorld(list_games("valid_seen", alfworld_data)[5], look_once=False)
    env.reset()
    first = env.step("look")[0]
    assert first.startswith(ROOM_PREFIX) and "nothing" not in first
    assert env.step("look")[0] == first
    env.close()


def test_raw_pddl_names(alfworld_data):
    env = ModifiedAlfWorld(list_games("valid_seen", alfworld_data)[5], demangle=False, expert=False)
    obs, info = env.reset()
    assert obs.startswith("Your task is to: ")
    assert info["expert_plan"] == []
    go = next(a for a in info["admissible_commands"] if a.startswith("go to "))
    assert "_bar_" in go  # e.g. "go to bed_bar__plus_00_dot_01_bar__minus_00_dot_06_bar__plus_01_dot_61"
    assert "_bar_" in env.step("look")[0]
    obs, *_ = env.step(go)
    assert obs.startswith(f"You arrive at {go.removeprefix('go to ')}")
    env.close()


@pytest.mark.slow
def test_expert_wins_through_look_once(alfworld_data):
    """The expert's extra looks are played silently, so its plan stays right to the end without a second look."""
    env = ModifiedAlfWorld(resolve_game(EXPERT_GAME, alfworld_data), seed=0)
    actions, observations, info = play_expert(env)
    assert info["won"] is True
    assert actions.count("look") == 1 and LOOK_REFUSAL not in observations
    # The same world actions as in the standard env, where the expert looks twice.
    plain = ModifiedAlfWorld(resolve_game(EXPERT_GAME, alfworld_data), look_once=False, seed=0)
    plain_actions = play_expert(plain)[0]
    assert plain_actions.count("look") >= 2
    assert actions == [a for i, a in enumerate(plain_actions) if a != "look" or i == 0]
    plain.close()
    # After the win the game is not touched any more.
    obs, reward, terminated, truncated, after = env.step("inventory")
    assert (obs, reward, terminated, truncated) == (EPISODE_OVER, 0.0, True, False)
    assert after["won"] is True
    env.close()

    # Reproducible: the same seed gives the same expert trajectory, also after library reuse.
    again = ModifiedAlfWorld(resolve_game(EXPERT_GAME, alfworld_data), seed=0)
    assert play_expert(again)[:2] == (actions, observations)
    again.close()


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
def test_each_split_resets_and_steps(alfworld_data, split):
    games = list_games(split, alfworld_data)
    env = ModifiedAlfWorld(games[len(games) // 2])
    argv = list(sys.argv)
    obs, info = env.reset()
    assert sys.argv == argv  # fast-downward's translator overwrites it; the env puts it back
    assert obs.startswith("Your task is to: ") and info["task_type"] in TASK_TYPES
    for action in ("look", info["expert_plan"][0], "inventory"):
        obs, reward, terminated, truncated, info = env.step(action)
        assert obs and reward == 0.0 and not terminated and not truncated
    env.close()


# ----------------------------------------------------------------------------- envs/pool.py
def _transcript(game: Path, actions: list[str]) -> list[str]:
    env = ModifiedAlfWorld(game)
    obs = [env.reset()[0]] + [env.step(a)[0] for a in actions]
    env.close()
    return obs


@pytest.mark.slow
def test_pool_matches_direct_env(alfworld_data):
    games = list_games("valid_seen", alfworld_data)[5:9]
    actions = ["look", "inventory", "look"]
    expected = {f"e{i}": _transcript(g, actions) for i, g in enumerate(games)}
    # Two workers (episodes spread out), then one worker hosting all four episodes interleaved.
    for workers in (2, 1):
        with EnvPool(num_workers=workers) as pool:
            resets = pool.reset_many([(f"e{i}", str(g)) for i, g in enumerate(games)])
            got = {r.episode_id: [r.obs] for r in resets}
            assert [r.episode_id for r in resets] == list(expected)
            for action in actions:
                requests = [(eid, action) for eid in reversed(expected)]
                results = pool.step_many(requests)
                assert [r.episode_id for r in results] == [eid for eid, _ in requests]
                for r in results:
                    assert not r.crashed, r.error
                    got[r.episode_id].append(r.obs)
            assert got == expected
            pids = {pool.worker_pid(eid) for eid in expected}
            assert len(pids) == workers


@pytest.mark.slow
def test_pool_survives_killed_worker(alfworld_data):
    games = list_games("valid_unseen", alfworld_data)[:4]
    with EnvPool(num_workers=2) as pool:
        pool.reset_many([(f"e{i}", str(g)) for i, g in enumerate(games)])
        victim_pid = pool.worker_pid("e0")
        hosted = sorted(eid for eid in (f"e{i}" for i in range(4)) if pool.worker_pid(eid) == victim_pid)
        survivors = sorted(set(f"e{i}" for i in range(4)) - set(hosted))
        assert hosted and survivors
        # SIGUSR1, the trainer's preemption notice, which SLURM may send to every process of the job: ignored.
        os.kill(victim_pid, signal.SIGUSR1)
        assert not any(r.crashed for r in pool.step_many([(eid, "look") for eid in hosted]))
        assert pool.worker_pid(hosted[0]) == victim_pid
        os.kill(victim_pid, signal.SIGKILL)

        results = {r.episode_id: r for r in pool.step_many([(f"e{i}", "inventory") for i in range(4)])}
        for eid in hosted:
            r = results[eid]
            assert r.crashed and r.terminated
            assert "died (exit code -9)" in r.error and "inventory" in r.error
        for eid in survivors:
            assert not results[eid].crashed and results[eid].obs
        # Later steps of lost episodes answer crashed too (no hang, no silent drop).
        again = pool.step_many([(hosted[0], "look")])[0]
        assert again.crashed and "died" in again.error
        assert set(pool.lost_episodes()) == set(hosted)

        # The pool keeps serving: new episodes, and a lost one reset afresh.
        fresh = pool.reset_many([("new", str(games[0])), (hosted[0], str(games[1]))])
        assert all(not r.crashed and r.obs.startswith("Your task is to:") for r in fresh)
        assert pool.worker_pid("new") not in (None, victim_pid)
        assert not pool.step_many([("new", "look")])[0].crashed


@pytest.mark.slow
def test_pool_env_exception_keeps_worker(alfworld_data):
    games = list_games("valid_seen", alfworld_data)[:2]
    with EnvPool(num_workers=1) as pool:
        pool.reset_many([("a", str(games[0])), ("b", str(games[1]))])
        pid = pool.worker_pid("a")
        a, b = pool.step_many([("a", None), ("b", "look")])  # None: env.step raises inside the worker
        assert a.crashed and a.terminated and a.error.startswith("AttributeError")
        assert not b.crashed and b.info["look"] == "first"
        assert pool.worker_pid("b") == pid  # same process, still alive
        assert pool.step_many([("a", "look")])[0].crashed
        # A bad game path is an ordinary error too.
        bad = pool.reset_many([("c", "/no/such/game.tw-pddl")])[0]
        assert bad.crashed and "MemexError" in bad.error and "no ALFWorld game" in bad.error
        assert not pool.step_many([("b", "inventory")])[0].crashed
        assert pool.worker_pid("b") == pid


@pytest.mark.slow
def test_pool_detects_hung_worker(alfworld_data):
    game = str(list_games("valid_seen", alfworld_data)[0])
    with EnvPool(num_workers=1) as pool:
        assert not pool.reset_many([("a", game)])[0].crashed  # generous timeout: a loaded machine resets slowly
        pool.timeout = 3.0
        pid = pool.worker_pid("a")
        os.kill(pid, signal.SIGSTOP)
        r = pool.step_many([("a", "look")])[0]
        assert r.crashed and "did not answer within 3 s" in r.error
        pool.timeout = 120.0
        fresh = pool.reset_many([("b", game)])[0]
        assert not fresh.crashed and pool.worker_pid("b") != pid


# ----------------------------------------------------------------------------- eval/bench_env.py
@pytest.mark.slow
def test_bench_env(alfworld_data):
    from eval.bench_env import bench_env, format_bench_env

    result = bench_env(list_games("valid_seen", alfworld_data)[:2], steps=12, worker_counts=(1, 2))
    for n in (1, 2):
        r = result["workers"][n]
        assert r["steps"] == 12 and r["steps_per_s"] > 0 and r["reset_s"] > 0 and r["crashed"] == 0
    assert result["speedup_2_over_1"] > 0
    text = format_bench_env(result)
    assert "steps/s" in text and "speedup" in text
