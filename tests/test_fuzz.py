"""Property test: thousands of random and adversarial assistant texts through parser + tools +
a real ALFWorld env, with no crash and the bookkeeping invariants intact."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import load_config
from common.engine import Completion
from envs.data import resolve_game
from envs.inline import InlineEnvs
from memory.store import InMemoryStore
from rewards import score_trajectory
from rollout.episode import Episode
from rollout.runner import make_renderer

TOOLS = ["execute_action", "CompressExperience", "ReadExperience", "finish", "fly", ""]
KEYS = ["action", "summary", "db_blocks", "db_index", "success", "db_content", "start_anchor", "mid_anchor",
        "end_anchor", "x"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
context_words = st.sampled_from(["You", "arrive", "fridge 1", "look", "middle of a room", "you see", "a", ".",
                                 "{{EXTRACT}}", "drawer 1", "Context Status", "\n", "  "])
anchor_block = st.fixed_dictionaries(
    {"db_index": st.sampled_from(["a", "b", "room", "bad idx", "x" * 70, ""])},
    optional={"start_anchor": context_words, "mid_anchor": context_words, "end_anchor": context_words,
              "db_content": st.text(max_size=30) | context_words},
)
structured = st.builds(
    lambda name, args: json.dumps({"name": name, "arguments": args}),
    st.sampled_from(TOOLS),
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=4)
    | st.fixed_dictionaries({"summary": st.text(max_size=60) | context_words,
                             "db_blocks": st.lists(anchor_block, max_size=3)})
    | st.fixed_dictionaries({"action": st.sampled_from(["look", "inventory", "go to drawer 1", "", "take"])})
    | st.fixed_dictionaries({"db_index": st.sampled_from(["a", "b", "room", "", "?"])}),
)
assistant_texts = st.one_of(
    st.text(max_size=200),
    structured.map(lambda body: f"ok <tool_call>{body}</tool_call>"),
    structured.map(lambda body: f"<tool_call>{body}"),  # unclosed
    structured.map(lambda body: f"<tool_call>{body}</tool_call><tool_call>{body}</tool_call>"),
    structured.map(lambda body: f"<tool_call>{body[: len(body) // 2]}</tool_call>"),  # truncated JSON
    st.just("<tool_call>" + "[" * 5000 + "</tool_call>"),
    st.just("</tool_call></tool_call><tool_call>"),
    st.just("<think><tool_call></think></tool_call>"),
)


class Harness:
    """One live episode on a real game, restarted whenever it ends."""

    def __init__(self, tokenizer, data_dir):
        self.cfg = load_config(None, [f"env.data_dir={data_dir}", "memory.threshold=300", "env.max_steps=100000"])
        self.tokenizer = tokenizer
        self.renderer = make_renderer(tokenizer, self.cfg)
        self.envs = InlineEnvs()
        self.game = str(resolve_game("valid_seen:4", data_dir))
        self.n = 0
        self.new_episode()

    def new_episode(self):
        self.n += 1
        self.episode = Episode(f"e{self.n}", self.game, self.renderer, InMemoryStore(), memory=self.cfg.memory,
                               env=self.cfg.env, rollout=self.cfg.rollout)
        (answer,) = self.envs.reset_many([(self.episode.id, self.game)])
        self.episode.start(answer)

    def feed(self, text):
        ep = self.episode
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:300] + [self.tokenizer.eos_token_id]
        before = dict(ep.store.as_dict())
        n_segments = len(ep.context.segments)
        action = ep.on_completion(Completion(text=text, token_ids=ids, logprobs=[0.0] * len(ids)))
        if action is not None:
            (answer,) = self.envs.step_many([(ep.id, action)])
            ep.on_env_result(answer)
        step = ep.traj.steps[-1]
        # Invariants: errors change nothing; W is the exact token count; segments = compressions + 1.
        if step.format_error:
            assert step.error and step.observation.startswith("Format error:")
        if step.error is not None and step.tool in ("CompressExperience", "ReadExperience"):
            assert ep.store.as_dict() == before and len(ep.context.segments) == n_segments
        assert step.working_tokens == len(ep.context.token_ids()) - ep.context.header_len
        assert len(ep.context.segments) == sum(s.compressed for s in ep.traj.steps) + 1
        if ep.done:
            assert score_trajectory(ep.traj, self.cfg.memory.threshold, self.cfg.reward)["total"] <= 1.0
            self.envs.close_episode(ep.id)
            self.new_episode()


@pytest.fixture(scope="module")
def harness(smol_tokenizer, alfworld_data):
    h = Harness(smol_tokenizer, alfworld_data)
    yield h
    h.envs.close()


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=assistant_texts)
def test_random_and_adversarial_texts_never_crash(harness, text):
    harness.feed(text)
