"""The policy's text is untrusted: no reply ends a replay, an evaluation or a GRPO run (issue 24, 1-2).

Each hostile reply below crashed the whole process before (a lone surrogate reached the
tokenizer or SQLite, deep JSON raised RecursionError, deeply nested arguments broke the
trajectory's serialisation, a huge integer raised ValueError) or flooded the context (a
100 KB index quoted back). Each must now be a format or tool error that the agent sees and
that costs its penalty, and the replay must still write a trajectory file. Faults that are not
the policy's (engine failures, a bug) end only their episode, as `crash`, and GRPO leaves them
out of their group.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import pytest
import torch

from common.config import load_config
from common.trajectory import CRASH, Step, Trajectory
from envs.data import resolve_game
from memexrl.cli import replay
from rollout.runner import make_renderer, open_envs, run_episodes
from rollout.scripted import ScriptedEngine
from training.batching import advantages_for, untied_groups
from training.log import rollout_metrics

BLOCK = '{"db_index": "a", "db_content": "x"}'


def raw_call(name: str, arguments_json: str) -> str:
    """A reply whose call is spliced in as raw JSON text: the escapes reach json.loads as the policy wrote them."""
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments_json}}}</tool_call>'


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


HOSTILE = {
    "lone surrogate in summary": (
        raw_call("CompressExperience", '{"summary": "room \\ud800", "db_blocks": [' + BLOCK + "]}"),
        "lone surrogate", True),
    "lone surrogate in db_content": (
        raw_call("CompressExperience", '{"summary": "s", "db_blocks": [{"db_index": "a", "db_content": "\\udfff"}]}'),
        "lone surrogate", True),
    "arguments nested 1,500 deep": (
        raw_call("execute_action", '{"action": "look", "x": ' + nested(1500) + "}"), "not valid JSON", True),
    "arguments nested 500 deep (parse, then broke asdict)": (
        raw_call("execute_action", '{"action": "look", "x": ' + nested(500) + "}"), "nested more than", True),
    "db_blocks string nested 3,000 deep": (
        raw_call("CompressExperience", json.dumps({"summary": "s", "db_blocks": nested(3000)})),
        "not a JSON list", False),
    "integer of 5,000 digits": (raw_call("execute_action", '{"action": ' + "9" * 5000 + "}"), "not valid JSON", True),
    "arguments string of a surrogate": (
        raw_call("execute_action", json.dumps('{"action": "\\ud800"}')), "lone surrogate", True),
}


@pytest.fixture(scope="module")
def setup(alfworld_data, smol_tokenizer):
    # room for replies of 100 KB: the scripted engine cuts a reply at rollout.max_new_tokens
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=400", "rollout.max_new_tokens=60000",
                             "rollout.max_context_tokens=200000"])
    return cfg, str(resolve_game("valid_seen:1", alfworld_data)), smol_tokenizer


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_reply_is_an_error_the_agent_sees(setup, tmp_path, case):
    cfg, game, tok = setup
    text, fragment, is_format_error = HOSTILE[case]
    look = raw_call("execute_action", '{"action": "inventory"}')
    out = replay(game, [text, look], cfg, tok)
    bad, after = out["steps"]
    assert fragment in bad["observation"] and bad["format_error"] is is_format_error
    assert bad["error"] and not bad["compressed"] and out["experience"] == {}
    assert after["observation"].startswith("You are not carrying anything")  # the episode played on
    assert (out["reward"]["format"] > 0) is is_format_error  # the penalty is paid
    path = tmp_path / "t.json"
    path.write_text(json.dumps(out, ensure_ascii=False), encoding="utf-8")  # the trajectory file is writable
    assert json.loads(path.read_text(encoding="utf-8"))["steps"][1]["observation"] == after["observation"]


@pytest.mark.parametrize("tool, arguments", [
    ("ReadExperience", {"db_index": "x" * 100_000}),
    ("CompressExperience", {"summary": "s", "db_blocks": [{"db_index": "y" * 100_000, "db_content": "z"}]}),
    ("execute_action_typo" * 5000, {"action": "look"}),
])
def test_error_observations_quote_a_short_prefix_only(setup, tool, arguments):
    cfg, game, tok = setup
    out = replay(game, [raw_call(tool, json.dumps(arguments))], cfg, tok)
    (step,) = out["steps"]
    assert step["error"] and "characters)" in step["observation"]
    assert len(step["observation"]) < 1_000  # the 100 KB value came back whole: 102,863 working tokens


class FailingEngine(ScriptedEngine):
    """A scripted policy whose engine fails on one episode's requests (a prompt it refuses, a server error)."""

    def __init__(self, tokenizer, scripts, victim):
        super().__init__(tokenizer, scripts)
        self.victim = victim

    def generate(self, requests):
        if any(r.episode_id == self.victim for r in requests):
            raise RuntimeError("the engine refused this prompt")
        return super().generate(requests)


@pytest.mark.slow
def test_an_engine_failure_crashes_its_episode_only(setup):
    cfg, game, tok = setup
    script = [raw_call("execute_action", '{"action": "inventory"}')] * 2
    engine = FailingEngine(tok, {"a": script, "b": script}, victim="a")
    with open_envs(cfg, num_workers=0) as envs:
        a, b = run_episodes([("a", game), ("b", game)], engine, envs, make_renderer(tok, cfg), cfg)
    assert a.end_reason == CRASH and a.crashed and "the engine refused this prompt" in a.error and not a.steps
    assert b.end_reason == "script_exhausted" and len(b.steps) == 2 and not b.crashed


def scored(total: float, end_reason: str = "finish") -> Trajectory:
    reward = {"total": total, "context": 0.0, "redundancy": 0.0, "format": 0.0}
    return Trajectory(game="g", task_type="pick", goal="x", success=total > 0, reward=reward, end_reason=end_reason)


def test_grpo_leaves_crashed_episodes_out_of_their_group():
    trajs = [scored(1.0), scored(0.0), scored(0.0, CRASH), scored(1.0, CRASH)]
    advantages, keep = advantages_for(trajs, [0, 0, 0, 0], "group", 1e-6)
    # the group is the two played episodes: R = (1, 0), mean 0.5, sample std 0.707
    assert advantages[:2] == pytest.approx([0.7071, -0.7071], abs=1e-3)
    assert keep == [True, True, False, False] and advantages[2:] == [0.0, 0.0]
    only_crashed = advantages_for([scored(0.0, CRASH), scored(1.0, CRASH)], [0, 0], "group", 1e-6)
    assert only_crashed == ([0.0, 0.0], [False, False])


def test_metrics_count_crashes_and_leave_them_out_of_the_means():
    metrics = rollout_metrics([scored(1.0), scored(0.0), scored(-1.0, CRASH)])
    assert metrics["num_crashed"] == 1
    assert metrics["success_rate"] == 0.5 and metrics["reward_mean"] == 0.5
    assert rollout_metrics([])["num_crashed"] == 0
    assert torch.tensor(rollout_metrics([scored(0.0, CRASH)])["success_rate"]) == 0.0
    stuck = scored(0.0, "step_limit")
    stuck.steps = [Step("cut", None, None, True, "Format error: unclosed <tool_call> tag", "e", 900)] * 5
    assert rollout_metrics([stuck, scored(1.0), scored(0.0)])["error_loop_frac"] == pytest.approx(1 / 3)


def test_untied_groups_are_the_ones_with_a_signal():
    trajs = [scored(1.0), scored(0.0), scored(0.5), scored(0.5), scored(1.0), scored(0.0, CRASH), scored(2.0)]
    groups = [0, 0, 1, 1, 2, 2, 3]
    # group 1 ties; group 2 has one played member (the other crashed); group 3 has one member
    assert untied_groups(trajs, groups) == [0]
