"""Replay on real ALFWorld games: every tool, every validation error, look-once, hidden actions,
redundancy and format accounting, segments and rewards (memex.md; design.md contracts)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import sqlite3

import pytest

from common.config import MemoryConfig, load_config
from common.errors import MemexError
from envs.alfworld import LOOK_REFUSAL, ModifiedAlfWorld
from envs.data import resolve_game
from memexrl.cli import replay
from memory.parsing import render_tool_call
from memory.tools import SUMMARY_HEADER, TRUNCATION_MARKER
from rollout.runner import episode_stores


def call(name: str, **arguments) -> str:
    return render_tool_call(name, arguments, "Thinking.")


def act(action: str) -> str:
    return call("execute_action", action=action)


@pytest.fixture(scope="module")
def cfg(alfworld_data):
    return load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=400"])


def expert_actions(game, max_steps=50):
    """The handcoded expert's winning actions for `game`, played through the modified env."""
    env = ModifiedAlfWorld(game)
    obs, info = env.reset()
    actions = []
    for _ in range(max_steps):
        plan = info["expert_plan"]
        if not plan:
            break
        actions.append(plan[0])
        obs, reward, done, _, info = env.step(plan[0])
        if done:
            env.close()
            return actions
    env.close()
    return None


@pytest.fixture(scope="module")
def won_game(cfg):
    for index in range(10):
        game = resolve_game(f"valid_seen:{index}", cfg.env.data_dir)
        actions = expert_actions(game)
        if actions:
            return str(game), actions
    pytest.fail("the handcoded expert won none of the first 10 valid_seen games")


def play(game, turns, cfg, tokenizer, overrides=()):
    if overrides:
        cfg = load_config(None, [f"env.data_dir={cfg.env.data_dir}", *overrides])
    return replay(game, turns, cfg, tokenizer)


def steps_of(out):
    return out["steps"]


def test_full_memex_episode_wins_with_segments_and_rewards(won_game, cfg, smol_tokenizer):
    game, actions = won_game
    look_first = actions[0] == "look"
    turns = [act("look")] + [act(a) for a in (actions[1:] if look_first else actions)]
    summary = "Room seen.\nroom_overview: receptacles of the room\ngoal_notes: what the task needs"
    compress = call(
        "CompressExperience",
        summary=summary,
        db_blocks=[
            {"db_index": "room_overview", "start_anchor": "You are in the middle", "mid_anchor": "you see",
             "end_anchor": "."},
            {"db_index": "goal_notes", "db_content": "Task from the first message; see {{EXTRACT}}",
             "start_anchor": "Looking quickly", "mid_anchor": "around", "end_anchor": "you see"},
        ],
    )
    # look, compress, read it back, then the rest of the expert's plan.
    script = [turns[0], compress, call("ReadExperience", db_index="room_overview")] + turns[1:]
    out = play(game, script, cfg, smol_tokenizer)
    assert out["success"] is True and out["end_reason"] == "env_done"
    assert out["reward"]["task"] == 1.0
    assert out["reward"]["total"] == pytest.approx(
        1.0 - out["reward"]["context"] - out["reward"]["redundancy"] - out["reward"]["format"]
    )
    stats = out["stats"]
    assert stats["num_compress"] == 1 and stats["num_read"] == 1 and stats["num_format_errors"] == 0
    assert len(out["segments"]) == stats["num_compress"] + 1
    first, second = out["segments"]
    assert (first["first_step"], first["last_step"]) == (0, 1)  # the compress call ends segment 1
    assert second["first_step"] == 2
    room = steps_of(out)[0]["observation"].split("\n\n")[0]
    assert out["experience"]["room_overview"] == room  # anchored: verbatim
    assert out["experience"]["goal_notes"] == "Task from the first message; see Looking quickly around you, you see"
    compressed = steps_of(out)[1]
    assert compressed["compressed"] and compressed["observation"].startswith(SUMMARY_HEADER)
    assert "room_overview" in compressed["observation"]
    assert steps_of(out)[2]["observation"].startswith(f"Retrieved [room_overview] ({len(room)} chars):\n{room}")
    for step in steps_of(out):
        assert "[Context Status: working tokens=" in step["observation"]
        assert f"working tokens={step['working_tokens']}," in step["observation"]


def test_modified_env_hides_room_and_admissible_and_looks_once(cfg, smol_tokenizer):
    game = str(resolve_game("valid_unseen:0", cfg.env.data_dir))
    out = play(game, [act("look"), act("look"), act("inventory")], cfg, smol_tokenizer)
    first, second, third = steps_of(out)
    assert first["observation"].startswith("You are in the middle of a room")
    assert second["observation"].startswith(LOOK_REFUSAL) and "ReadExperience" in second["observation"]
    assert third["observation"].startswith("You are not carrying anything")
    for step in steps_of(out):
        assert "admissible" not in step["observation"].lower()
    assert out["end_reason"] == "script_exhausted" and out["success"] is False


def test_standard_mode_switches_show_admissible(cfg, smol_tokenizer):
    game = str(resolve_game("train:0", cfg.env.data_dir))
    out = play(game, [act("inventory")], cfg, smol_tokenizer, ["env.hide_admissible=false"])
    assert "admissible" in steps_of(out)[0]["observation"].lower()


@pytest.mark.parametrize(
    "arguments, fragment, is_format_error",
    [
        ({"summary": "", "db_blocks": [{"db_index": "a", "db_content": "x"}]}, "summary is empty", False),
        ({"summary": "s"}, "missing the required argument 'db_blocks'", True),
        ({"summary": "s", "db_blocks": []}, "db_blocks is empty", False),
        ({"summary": "s", "db_blocks": 7}, "must be of type", True),
        ({"summary": "s", "db_blocks": "not json"}, "not a JSON list", False),
        ({"summary": "s", "db_blocks": [{"db_content": "x"}]}, "has no db_index", False),
        ({"summary": "s", "db_blocks": [{"db_index": "bad index!", "db_content": "x"}]}, "invalid db_index", False),
        ({"summary": "s", "db_blocks": [{"db_index": "a", "db_content": "x"}, {"db_index": "a", "db_content": "y"}]},
         "appears twice", False),
        ({"summary": "s", "db_blocks": [{"db_index": "a", "start_anchor": "You"}]}, "needs all three anchors", False),
        ({"summary": "s", "db_blocks": [{"db_index": "a", "start_anchor": "zebra", "mid_anchor": "q",
                                          "end_anchor": "w"}]}, "anchors not found", False),
        ({"summary": "s", "db_blocks": [{"db_index": "a"}]}, "neither db_content nor anchors", False),
        ({"summary": "s", "db_blocks": [{"db_index": "a", "db_content": "   \n"}]}, "db_content is only whitespace",
         False),  # the release rejects it; it was stored
        ({"summary": "s", "db_blocks": [{"db_index": "a", "start_anchor": " ", "mid_anchor": " ", "end_anchor": " "}]},
         "start_anchor, mid_anchor, end_anchor must not be only whitespace", False),  # stored one space before
        ({"summary": "Progress ... Index map:\n- facts: what it holds",
          "db_blocks": [{"db_index": "facts", "db_content": "exact text"}]},
         "the format example's placeholder", False),  # the hint copied after a format error: it archived 'exact text'
    ],
)
def test_compress_validation_errors_change_nothing(cfg, smol_tokenizer, arguments, fragment, is_format_error):
    game = str(resolve_game("valid_seen:1", cfg.env.data_dir))
    out = play(game, [act("look"), call("CompressExperience", **arguments), act("inventory")], cfg, smol_tokenizer)
    look, bad, after = steps_of(out)
    assert fragment in bad["observation"]
    assert bad["format_error"] is is_format_error
    assert not bad["compressed"] and out["experience"] == {} and len(out["segments"]) == 1
    assert look["working_tokens"] < bad["working_tokens"] < after["working_tokens"]  # context kept growing


def test_db_blocks_as_json_string_is_accepted(cfg, smol_tokenizer):
    game = str(resolve_game("valid_seen:1", cfg.env.data_dir))
    blocks = json.dumps([{"db_index": "note", "db_content": "apple is in fridge 1"}])
    out = play(game, [call("CompressExperience", summary="note: apple", db_blocks=blocks)], cfg, smol_tokenizer)
    assert out["experience"] == {"note": "apple is in fridge 1"} and len(out["segments"]) == 2


def test_read_miss_lists_indices_and_fallback_suggests(cfg, smol_tokenizer):
    game = str(resolve_game("valid_seen:2", cfg.env.data_dir))
    script = [
        call("CompressExperience", summary="fridge_contents: what is in the fridge",
             db_blocks=[{"db_index": "fridge_contents", "db_content": "apple 2, lettuce 1"}]),
        call("ReadExperience", db_index="fridge"),
    ]
    plain = steps_of(play(game, script, cfg, smol_tokenizer))[1]
    assert "no block with index 'fridge'" in plain["observation"]
    assert "Available indices: fridge_contents" in plain["observation"]
    assert "apple 2" not in plain["observation"]  # never another block's content
    fallback = steps_of(play(game, script, cfg, smol_tokenizer, ["memory.semantic_fallback=true"]))[1]
    assert "Closest matches: fridge_contents" in fallback["observation"]


def test_summary_is_capped_in_real_tokens(cfg, smol_tokenizer):
    game = str(resolve_game("valid_seen:3", cfg.env.data_dir))
    long_summary = " ".join(f"fact{i}: the mug {i} is in cabinet {i}." for i in range(200))
    out = play(game, [call("CompressExperience", summary=long_summary,
                           db_blocks=[{"db_index": "facts", "db_content": long_summary}])], cfg, smol_tokenizer,
               ["rollout.max_new_tokens=8192"])
    shown = steps_of(out)[0]["observation"]
    assert TRUNCATION_MARKER in shown
    kept = shown.split("\n", 2)[2].split(TRUNCATION_MARKER)[0]
    assert len(smol_tokenizer(kept.strip(), add_special_tokens=False)["input_ids"]) <= 300 + 2
    assert out["experience"]["facts"] == long_summary  # the store keeps everything


def test_redundancy_and_format_accounting(cfg, smol_tokenizer):
    game = str(resolve_game("train:5", cfg.env.data_dir))
    script = [
        act("look"), act("inventory"), act("inventory"),  # the second inventory is redundant
        "no call at all",                                   # not an attempt
        "<tool_call>{oops</tool_call>",                    # format error
        act("inventory"),                                   # still redundant
    ]
    out = play(game, script, cfg, smol_tokenizer)
    assert [s["redundant"] for s in steps_of(out)] == [False, False, True, False, False, True]
    assert out["stats"]["num_redundant"] == 2 and out["stats"]["num_format_errors"] == 1
    assert out["reward"]["redundancy"] == pytest.approx(0.05 * 2 / 4)
    assert out["reward"]["format"] == pytest.approx(1 / 5)
    assert out["reward"]["task"] == 0.0


def test_step_limit_ends_episode(cfg, smol_tokenizer):
    game = str(resolve_game("valid_unseen:1", cfg.env.data_dir))
    out = play(game, [act("inventory")] * 5, cfg, smol_tokenizer, ["env.max_steps=3"])
    assert out["end_reason"] == "step_limit" and out["stats"]["num_steps"] == 3


def test_context_penalty_grows_past_threshold(cfg, smol_tokenizer):
    game = str(resolve_game("valid_unseen:2", cfg.env.data_dir))
    out = play(game, [act("look")] + [act(f"examine drawer {i}") for i in range(1, 9)], cfg, smol_tokenizer,
               ["memory.threshold=150"])
    over = [max(0, s["working_tokens"] - 150) for s in steps_of(out)]
    assert out["reward"]["context"] == pytest.approx(min(1.0, sum(over) / (150 * len(over))))
    assert out["reward"]["context"] > 0
    assert "[WARNING: working context exceeds the threshold" in steps_of(out)[-1]["observation"]


def test_sqlite_stores_never_leak_between_runs(cfg, smol_tokenizer, tmp_path):
    game = str(resolve_game("valid_seen:1", cfg.env.data_dir))
    db = tmp_path / "shared.sqlite"
    sqlite = ["memory.backend=sqlite", f"memory.sqlite_path={db}"]
    write = call("CompressExperience", summary="secret: kept", db_blocks=[{"db_index": "secret", "db_content": "42"}])
    first = play(game, [write, call("ReadExperience", db_index="secret")], cfg, smol_tokenizer, sqlite)
    assert first["steps"][1]["observation"].startswith("Retrieved [secret]")  # the same run reads its block
    second = play(game, [call("ReadExperience", db_index="secret")], cfg, smol_tokenizer, sqlite)
    assert "no block with index 'secret'" in second["steps"][0]["observation"]  # same episode id, another run
    assert "42" not in second["steps"][0]["observation"]
    with sqlite3.connect(db) as conn:  # the first run's block is kept, under that run's own id
        namespaces = [row[0] for row in conn.execute("SELECT DISTINCT namespace FROM memex_blocks")]
    assert len(namespaces) == 1 and namespaces[0].endswith("/replay")


def test_sqlite_store_defaults_into_the_run_directory(tmp_path):
    stores = episode_stores(MemoryConfig(backend="sqlite"), tmp_path / "run")
    store = stores("eval-0")
    store.write("a", "x", step=0)
    store.close()
    assert (tmp_path / "run" / "memory.sqlite").is_file()
    with pytest.raises(MemexError, match="memory.sqlite_path"):
        episode_stores(MemoryConfig(backend="sqlite"), None)
