"""Property test: 10,000 random and adversarial assistant texts through parser, memory tools, working
context, a real ALFWorld env, the experience store (in memory and SQLite), rewards and the trajectory
JSON, with no exception and the bookkeeping invariants intact (issue 24: the policy's text is
untrusted). The hostile ones: lone surrogates (raw, and as JSON escapes), control characters, JSON
nested thousands deep, integers past Python's digit limit, 100 KB strings, many calls, wrong types."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import load_config
from common.engine import Completion, valid_unicode
from envs.data import resolve_game
from envs.inline import InlineEnvs
from memory.store import InMemoryStore, open_store
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
# Hostile pieces spliced into the JSON text of a call, as the policy could write them.
escapes = st.sampled_from(["\\ud800", "\\udfff", "\\u0000", "\\u001b[31m", "\\n", "\\ud83d\\ude00", "\\"])
hostile_strings = st.one_of(
    st.text(st.characters(categories=["Cs", "Cc", "Co", "Zl", "Zp"]), max_size=30),  # raw surrogates, controls
    st.lists(escapes, max_size=6).map("".join),
    st.integers(1_000, 20_000).map(lambda n: "x" * n),  # huge (100 KB ones: tests/test_untrusted.py)
)
TOOL_ARGUMENT = {"execute_action": "action", "CompressExperience": "summary", "ReadExperience": "db_index"}


def splice(name: str, value: str) -> str:
    """A call whose one argument is `value` written raw between the JSON quotes (escapes decoded by the parser)."""
    argument = TOOL_ARGUMENT.get(name, "x")
    blocks = ', "db_blocks": [{"db_index": "a", "db_content": "' + value + '"}]' if name == "CompressExperience" else ""
    return f'<tool_call>{{"name": "{name}", "arguments": {{"{argument}": "{value}"{blocks}}}}}</tool_call>'


hostile = st.one_of(
    st.builds(splice, st.sampled_from(list(TOOL_ARGUMENT)), hostile_strings),
    st.integers(2, 3_000).map(lambda d: splice("execute_action", "look").replace('"look"', "[" * d + "]" * d)),
    st.integers(2, 3_000).map(lambda d: splice("CompressExperience", "s").replace(
        '"db_blocks": [', '"db_blocks": "' + "[" * d + "]" * d + '", "x": [')),
    st.integers(4_301, 6_000).map(lambda n: splice("execute_action", "look").replace('"look"', "7" * n)),
    st.integers(2, 50).map(lambda k: splice("ReadExperience", "a") * k),  # many calls
    hostile_strings.map(lambda s: f"free text {s} <tool_call>{s}</tool_call>"),
)
assistant_texts = st.one_of(
    hostile,
    hostile,  # half the examples are hostile
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

    def __init__(self, tokenizer, data_dir, sqlite_path):
        self.cfg = load_config(None, [f"env.data_dir={data_dir}", "memory.threshold=300", "env.max_steps=100000"])
        self.tokenizer = tokenizer
        self.renderer = make_renderer(tokenizer, self.cfg)
        self.envs = InlineEnvs()
        self.game = str(resolve_game("valid_seen:4", data_dir))
        self.sqlite_path = sqlite_path
        self.fed = 0
        self.n = 0
        self.new_episode()

    def new_episode(self):
        self.n += 1
        store = InMemoryStore() if self.n % 2 else open_store("sqlite", self.sqlite_path, namespace=f"e{self.n}")
        self.episode = Episode(f"e{self.n}", self.game, self.renderer, store, memory=self.cfg.memory,
                               env=self.cfg.env, rollout=self.cfg.rollout)
        (answer,) = self.envs.reset_many([(self.episode.id, self.game)])
        self.episode.start(answer)

    def feed(self, text):
        ep = self.episode
        self.fed += 1
        ids = self.tokenizer(valid_unicode(text), add_special_tokens=False)["input_ids"][:300]
        ids.append(self.tokenizer.eos_token_id)
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
        if step.error is not None:  # errors quote a short prefix of what the agent wrote (a hit returns the block)
            assert len(step.observation) < 20_000
        json.dumps(step.to_json(), ensure_ascii=False).encode("utf-8")  # each step serialises as UTF-8
        if ep.done or self.fed % 100 == 0:
            assert score_trajectory(ep.traj, self.cfg.memory.threshold, self.cfg.reward)["total"] <= 1.0
            json.dumps(ep.traj.to_json(with_tokens=True), ensure_ascii=False).encode("utf-8")
        if ep.done:
            self.envs.close_episode(ep.id)
            ep.store.close()
            self.new_episode()


@pytest.fixture(scope="module")
def harness(smol_tokenizer, alfworld_data, tmp_path_factory):
    h = Harness(smol_tokenizer, alfworld_data, tmp_path_factory.mktemp("fuzz") / "store.sqlite")
    yield h
    h.envs.close()


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(text=assistant_texts)
def test_random_and_adversarial_texts_never_crash(harness, text):
    harness.feed(text)
