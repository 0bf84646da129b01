"""Each agent's context policy (rollout/strategies.py): what is in the prompt at step t, on a real game with
a scripted policy, the real env and the real tokenizer."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402

from common.config import load_config  # noqa: E402
from envs.data import resolve_game  # noqa: E402
from memory.parsing import render_tool_call  # noqa: E402
from rollout.runner import make_renderer, open_envs, run_episodes  # noqa: E402
from rollout.scripted import ScriptedEngine  # noqa: E402
from rollout.strategies import AGENT_NAMES, CHAIN_HEADER, make_agent, state_summary  # noqa: E402

GAME = "valid_unseen:0"
MOVES = ["go to drawer 1", "open drawer 1", "go to drawer 2", "open drawer 2", "go to shelf 1"]


def call(name, **arguments):
    return render_tool_call(name, arguments)


def act(action, state=None):
    return (f"State: {state}\n" if state else "") + call("execute_action", action=action)


class RecordingEngine(ScriptedEngine):
    """A scripted policy that keeps the decoded prompt of every turn."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, {"e0": script})
        self.prompts: list[str] = []

    def generate(self, requests):
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        return super().generate(requests)


@pytest.fixture(scope="module")
def play(alfworld_data, smol_tokenizer):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=2000"])
    game = str(resolve_game(GAME, alfworld_data))

    def run(agent, script):
        engine = RecordingEngine(smol_tokenizer, script)
        with open_envs(cfg, 0) as envs:
            traj = run_episodes([("e0", game)], engine, envs, make_renderer(smol_tokenizer, cfg, agent), cfg,
                                agent=agent)[0]
        return traj, engine.prompts

    return run


def test_make_agent_names():
    assert {make_agent(n).name for n in AGENT_NAMES} == set(AGENT_NAMES)
    assert make_agent("truncate", keep_turns=3).keep_turns == 3
    with pytest.raises(ValueError, match="unknown agent"):
        make_agent("oracle")
    assert state_summary("State: at drawer 1, it is closed\n<tool_call>{}</tool_call>") == "at drawer 1, it is closed"
    assert state_summary("I go on.\n<tool_call>{}</tool_call>") == "I go on."


@pytest.mark.slow
def test_full_keeps_everything_and_has_no_memory_tools(play):
    traj, prompts = play(make_agent("full"), [act("look"), *map(act, MOVES),
                                               call("CompressExperience", summary="s", db_blocks=[])])
    last = prompts[-1]
    assert all(s.observation.split("\n\n[Context Status")[0] in last for s in traj.steps[:-1])
    assert "CompressExperience" not in prompts[0] and "[Context Status" not in last
    assert traj.steps[-1].format_error and "unknown tool" in traj.steps[-1].observation
    assert traj.stats["num_compress"] == 0


@pytest.mark.slow
def test_truncate_keeps_the_last_k_turns(play):
    traj, prompts = play(make_agent("truncate", keep_turns=2), [act("look"), *map(act, MOVES)])
    observations = [s.observation for s in traj.steps]
    at_step_5 = prompts[5]  # the prompt of the 6th reply: after 5 observations
    assert observations[3] in at_step_5 and observations[4] in at_step_5
    assert observations[0] not in at_step_5 and observations[2] not in at_step_5
    assert traj.steps[0].observation in prompts[1]  # nothing dropped before k turns
    assert "Your task is to" in at_step_5  # the task message always stays


@pytest.mark.slow
def test_summary_compresses_without_a_store(play):
    script = [act("look"), act(MOVES[0]), call("CompressExperience", summary="Drawer 1 is closed; the room has shelves."),
              call("ReadExperience", db_index="room"), act(MOVES[1])]
    traj, prompts = play(make_agent("summary"), script)
    assert traj.steps[2].compressed and traj.experience == {}
    assert "Drawer 1 is closed" in prompts[3] and traj.steps[0].observation.split("\n\n[")[0] not in prompts[3]
    assert traj.steps[3].format_error  # no ReadExperience in this mode
    assert "db_blocks" not in prompts[0]  # its CompressExperience takes only a summary
    assert traj.stats["num_compress"] == 1 and len(traj.segments) == 2


@pytest.mark.slow
def test_m2_sees_its_summary_chain_and_the_newest_observation(play):
    insights = ("Desk lamps are often on desks or side tables.",)
    states = [f"step {i} summary" for i in range(4)]
    script = [act(a, s) for a, s in zip(["look", *MOVES[:3]], states)]
    traj, prompts = play(make_agent("m2", insights=insights), script)
    at_step_3 = prompts[3]
    assert CHAIN_HEADER in at_step_3 and all(s in at_step_3 for s in states[:3])
    assert traj.steps[2].observation in at_step_3  # the newest observation
    assert traj.steps[0].observation not in at_step_3 and traj.steps[1].observation not in at_step_3
    assert insights[0] in prompts[0] and "State:" in prompts[0]
    assert max(s.working_tokens for s in traj.steps) < traj.steps[0].working_tokens + 200
