"""The `memex` LME-V2 memory: the policy archives trajectories through the agent loop and reads them back."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402

import pytest  # noqa: E402

from common.config import load_config  # noqa: E402
from common.errors import MemexError  # noqa: E402
from envs.reading import LAST_PAGE_NOTE  # noqa: E402
from eval.lme.memory.base import MemoryOptions, load_memory, make_memory  # noqa: E402
from eval.lme.memory.memex import QUERY_EPISODES_FILE, READ_DONE, STORE_FILE, InsertPager, insert_task  # noqa: E402
from memory.parsing import render_tool_call as call  # noqa: E402
from rollout.scripted import ScriptedEngine  # noqa: E402

AXTREE = "[a1] RootWebArea 'ShopNova Admin'\n  [a7] heading 'Store settings'\n  [a12] textbox 'Currency' value: 'EUR'"
TRAJ = {
    "id": "traj-42", "domain": "web", "goal": "Check the store currency", "start_url": "http://shopnova/admin",
    "outcome": "success",
    "states": [
        {"url": "http://shopnova/admin", "action": "click('a3')", "thought": "Open settings.",
         "accessibility_tree": "[a1] RootWebArea 'ShopNova Admin'\n  [a3] link 'Settings'"},
        {"url": "http://shopnova/admin/settings", "action": "send_msg_to_user('EUR')", "thought": "Found it.",
         "accessibility_tree": AXTREE},
        {"url": "http://shopnova/admin/settings", "action": None, "thought": "", "accessibility_tree": AXTREE},
    ],
}


INSERT = [
    call("execute_action", {"action": "next"}, "Show me the states."),
    call("execute_action", {"action": "next"}),
    call("CompressExperience", {
        "summary": "Store settings seen.\nIndex map:\n- currency: the settings page with the currency field\n"
                   "- facts: what the trajectory found",
        "db_blocks": [
            {"db_index": "currency", "start_anchor": "[a7] heading", "mid_anchor": "Currency",
             "end_anchor": "value: 'EUR'"},
            {"db_index": "facts", "db_content": "The ShopNova store currency is EUR (Settings page)."},
        ]}, "Archive the currency."),
    call("finish", {}),
]
QUERY = [call("ReadExperience", {"db_index": "currency"}, "The currency block."), call("finish", {})]


@pytest.fixture
def options(tmp_path, smol_tokenizer):
    def make(workdir, query=QUERY, inserts=(INSERT,), failing=None, **settings):
        """The options of a memex memory whose policy plays `inserts` (one script a trajectory, in order) and `query`;
        the engine fails every request of the episode `failing` (FailingOn)."""
        scripts = {f"insert-t{n:04d}": script for n, script in enumerate(inserts)}
        engine = (FailingOn(smol_tokenizer, {**scripts, "query": query}, failing) if failing else
                  ScriptedEngine(smol_tokenizer, {**scripts, "query": query}))
        cfg = load_config(None, ["memory.threshold=1000", "rollout.max_context_tokens=8192"])
        return MemoryOptions(extra={"engine": (engine, smol_tokenizer), "config": cfg, "workdir": str(workdir),
                                    **settings})
    return make


def test_insert_pages_a_trajectory_as_the_reading_env_does_and_stops_before_the_question():
    pager = InsertPager(insert_task(TRAJ, per_chunk=2, max_chars=500, max_reads=3, shortlist=12))
    assert pager.reset().info["task"]["kind"] == "reading"  # the agent loop gives it the reading system prompt
    first, second, after = pager.step("next"), pager.step("go to cabinet 1"), pager.step("next")
    assert "Check the store currency" in first.obs and "State 1" in first.obs and "State 2" not in first.obs
    assert "State 2" in second.obs and second.obs.endswith(LAST_PAGE_NOTE) and not second.terminated
    assert after.terminated and after.obs == READ_DONE


def test_what_the_policy_archives_is_the_context_and_survives_a_restart(options, tmp_path):
    memory = make_memory("memex", options(tmp_path / "work"))
    memory.insert(TRAJ)
    assert memory.inserted() == []  # queued: read in a batch at flush (the harness flushes after the last insert)
    memory.flush()
    assert memory.inserted() == ["traj-42"]
    # The anchor block is copied exactly from the AXTree the policy saw; its catalog line is the policy's own
    # index-map line, as in a training catalog (no trajectory goal: catalog_goal is false by default).
    block = memory.store.read("currency")
    assert block.mode == "anchor" and block.content == "[a7] heading 'Store settings'\n  [a12] textbox 'Currency' value: 'EUR'"
    assert block.description == "the settings page with the currency field"
    assert memory.store.read("facts").content.startswith("The ShopNova store currency is EUR")
    first = memory.query("What currency does the ShopNova store use?")
    assert len(first) == 1 and first[0]["type"] == "text" and "value: 'EUR'" in first[0]["value"]
    memory.save(tmp_path / "saved")
    memory.close()
    # Reopen from the saved directory (a new process would do the same): same store, same context.
    again = load_memory("memex", tmp_path / "saved", options(tmp_path / "elsewhere"))
    assert again.inserted() == ["traj-42"]
    again.warm_up()
    assert again._engine is not None  # started before the first query, which the harness times
    assert again.query("What currency does the ShopNova store use?") == first
    again.close()
    # the saved directory keeps the memory alone: a loaded memory logs its questions in its own workdir
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [STORE_FILE]
    assert len((tmp_path / "elsewhere" / QUERY_EPISODES_FILE).read_text().splitlines()) == 1


def test_a_missing_saved_memory_is_one_clear_error(options, tmp_path):
    with pytest.raises(MemexError, match=STORE_FILE):
        load_memory("memex", tmp_path / "nothing", options(tmp_path / "w"))


def test_reads_are_bounded_and_a_bad_index_reads_nothing(tmp_path, options):
    reads = [call("ReadExperience", {"db_index": "nope"})] + [call("ReadExperience", {"db_index": "facts"})] * 5
    memory = make_memory("memex", options(tmp_path, reads, max_reads=2))
    memory.insert(TRAJ)
    items = memory.query("currency?")
    assert [i["value"].split("]")[0] for i in items] == ["[facts"]  # the same block once, the miss not at all
    logged = [json.loads(line) for line in (tmp_path / "query_episodes.jsonl").read_text().splitlines()]
    assert [(q["question"], q["read"]) for q in logged] == [("currency?", ["facts"])]
    assert [s["arguments"]["db_index"] for s in logged[0]["steps"]] == ["nope"] + ["facts"] * 3  # max_reads + 2 turns
    memory.close()


def test_queued_trajectories_are_read_together_and_keep_their_order(tmp_path, options):
    other = {**TRAJ, "id": "traj-43", "goal": "Look at the orders"}
    memory = make_memory("memex", options(tmp_path, inserts=(INSERT, INSERT[:2] + INSERT[3:]), insert_batch=8))
    memory.insert(TRAJ)
    memory.insert(other)
    memory.flush()
    assert memory.inserted() == ["traj-42", "traj-43"]
    assert memory.store.indices() == ["currency", "facts"]  # the second archived nothing
    episodes = [json.loads(line) for line in (tmp_path / "insert_episodes.jsonl").read_text().splitlines()]
    assert [e["trajectory_id"] for e in episodes] == ["traj-42", "traj-43"]
    assert [e["end_reason"] for e in episodes] == ["finish", "finish"]
    memory.close()


@pytest.mark.parametrize("index_names, stored", [
    ("policy", ["currency", "currency-2", "facts", "facts-2"]),  # the names a training catalog shows
    ("prefixed", ["t0000-currency", "t0000-facts", "t0001-currency", "t0001-facts"]),
])
def test_blocks_are_stored_under_the_policys_own_names_unless_prefixed(tmp_path, options, index_names, stored):
    """The reading env's catalog shows the indices the policy wrote (`-2` where a name is taken), so the controller
    stores them so by default: a policy trained there reads `currency`, not `t0000-currency`."""
    other = {**TRAJ, "id": "traj-43"}
    memory = make_memory("memex", options(tmp_path, inserts=(INSERT, INSERT), index_names=index_names))
    memory.insert(TRAJ)
    memory.insert(other)
    memory.flush()
    assert sorted(memory.store.indices()) == stored
    memory.close()
    with pytest.raises(MemexError, match="index_names must be"):
        make_memory("memex", options(tmp_path / "x", index_names="t"))


def test_catalog_goal_appends_the_trajectorys_goal_to_each_catalog_line(tmp_path, options):
    """`--set catalog_goal=true`: the first controller's catalog lines, `<what it holds> (trajectory goal: ...)`."""
    memory = make_memory("memex", options(tmp_path / "a", catalog_goal=True))
    memory.insert(TRAJ)
    memory.flush()
    expected = "the settings page with the currency field (trajectory goal: Check the store currency)"
    assert memory.store.read("currency").description == expected
    memory.close()
    with pytest.raises(MemexError, match="catalog_goal must be true or false"):
        make_memory("memex", options(tmp_path / "b", catalog_goal="yes"))


def test_an_env_action_at_query_time_gets_the_reading_envs_answer_and_the_reads_still_count(tmp_path, options):
    """The policy may call execute_action after the question (the page-end start at step 60 did, with "next"): the
    controller answers as the reading env does then (NO_MORE_STATES), so the call is a recorded turn with a reply,
    not an unanswered call the next turn is generated after, and the read that follows reaches the context."""
    from envs.reading import NO_MORE_STATES

    query = [call("execute_action", {"action": "next"}, "Block 'currency' is the catalog's next match."), *QUERY]
    memory = make_memory("memex", options(tmp_path, query))
    memory.insert(TRAJ)
    context = memory.query("What currency does the ShopNova store use?")
    assert len(context) == 1 and "value: 'EUR'" in context[0]["value"]
    (episode,) = [json.loads(line) for line in (tmp_path / "query_episodes.jsonl").read_text().splitlines()]
    assert [s["tool"] for s in episode["steps"]] == ["execute_action", "ReadExperience", "finish"]
    assert episode["steps"][0]["observation"].startswith(NO_MORE_STATES)
    memory.close()


@pytest.mark.parametrize("status_indices", ["catalog", "all"])
def test_a_questions_status_names_its_catalogs_blocks_and_every_block_stays_readable(tmp_path, options,
                                                                                     status_indices):
    """`status_indices: catalog` (the default): a question episode's context status and a missed read's error name the
    blocks its catalog shows, as a training question's do (its archive is that small); `all`: every archived block."""
    import re

    from memory.catalog import catalog_indices

    reads = [call("ReadExperience", {"db_index": i}) for i in ("nope", "currency", "facts")] + [call("finish", {})]
    memory = make_memory("memex", options(tmp_path, reads, shortlist=1, status_indices=status_indices))
    memory.insert(TRAJ)
    question = "Which settings page has the currency field?"
    context = memory.query(question)
    assert sorted(item["value"].split("]")[0] for item in context) == ["[currency", "[facts"]  # both read back
    (shown,) = catalog_indices(memory.store, question, 1, memory.cfg.memory.catalog_rank_chars)
    named = shown if status_indices == "catalog" else "currency, facts"
    (episode,) = [json.loads(line) for line in (tmp_path / "query_episodes.jsonl").read_text().splitlines()]
    observations = [step["observation"] for step in episode["steps"][:3]]
    assert [re.search(r"\[Available indices: ([^\]]*)\]", o).group(1) for o in observations] == [named] * 3
    assert f"no block with index 'nope'. Available indices: {named}\n" in observations[0]
    memory.close()
    with pytest.raises(MemexError, match="status_indices must be 'catalog' or 'all'"):
        make_memory("memex", options(tmp_path / "x", status_indices="some"))


class FailingOn(ScriptedEngine):
    """The scripted policy, with an engine fault (a server error, a timeout) on every request of one episode."""

    def __init__(self, tokenizer, scripts, failing: str):
        super().__init__(tokenizer, scripts)
        self.failing = failing

    def generate(self, requests):
        if any(r.episode_id == self.failing for r in requests):
            raise RuntimeError("the vLLM server did not answer")
        return super().generate(requests)


@pytest.mark.parametrize("failing", ["insert-t0000", "query"])
def test_an_engine_fault_ends_one_episode_not_the_evaluation(tmp_path, options, failing):
    """A request the engine fails on (was: the exception ended the whole `eval lme` run) crashes its own episode:
    the other trajectory is archived, and a question whose episode crashed returns what it had read (nothing)."""
    other = {**TRAJ, "id": "traj-43"}
    memory = make_memory("memex", options(tmp_path, inserts=(INSERT, INSERT), failing=failing, insert_batch=8))
    memory.insert(TRAJ)
    memory.insert(other)
    memory.flush()
    episodes = [json.loads(line) for line in (tmp_path / "insert_episodes.jsonl").read_text().splitlines()]
    ends = {e["trajectory_id"]: e["end_reason"] for e in episodes}
    assert memory.inserted() == ["traj-42", "traj-43"]
    assert memory.store.indices() == (["currency", "facts"] if failing == "insert-t0000" else
                                      ["currency", "facts", "currency-2", "facts-2"])
    assert ends == ({"traj-42": "crash", "traj-43": "finish"} if failing == "insert-t0000" else
                    {"traj-42": "finish", "traj-43": "finish"})
    items = memory.query("What currency does the ShopNova store use?")
    assert (items == []) == (failing == "query")
    memory.close()


def test_a_batch_whose_every_episode_crashed_stops_the_evaluation(tmp_path, options):
    """An engine that fails every request (a server gone for good) is not a result of empty memories."""
    memory = make_memory("memex", options(tmp_path, failing="insert-t0000"))
    memory.insert(TRAJ)
    with pytest.raises(MemexError, match="every memex episode of this batch of 1 trajectories crashed; the first: "
                                         "engine: RuntimeError: the vLLM server did not answer"):
        memory.flush()
    memory.close()
