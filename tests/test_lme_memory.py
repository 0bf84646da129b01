"""LME-V2 memory modules (eval/lme/memory/): registry, slicing, rag, rag_notes, agentrunbook_r, m2.

Trajectories are written here by hand in the real schema (lme-v2.md "Data layout"), one of them
holding a planted fact; embeddings are the real offline MiniLM; LLMs are scripted fakes, except
one short SmolLM2 run marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.errors import MemexError
from eval.lme.memory.agentrunbook_r import fallback_bundle, merge_slice_hits, parse_query_bundle
from eval.lme.memory.base import MemoryOptions, load_memory, make_memory, memory_class
from eval.lme.memory.index import PAPER_QUERY_INSTRUCTION, make_embedder
from eval.lme.memory.m2 import distill, step_text, succeeded
from eval.lme.memory.notes import NOTE_SYSTEM_PROMPT, REPAIR_PROMPT
from eval.lme.memory.slices import Hit, simplify, slice_bounds, slice_entries, transitions

FACT = "$413.27"


def state(tid: str, k: int, url: str, tree: str, action: str | None, thought: str = "") -> dict:
    return {"url": url, "action": action, "thought": thought, "accessibility_tree": tree,
            "screenshot": f"screenshots/{tid}/{k}.png", "step": k}


def make_trajectories() -> list[dict]:
    shop = "http://localhost:7770"
    chair = [
        state("t1", 0, f"{shop}/", "[a1] RootWebArea 'One Stop Market'\n[a2] searchbox 'Search'\n[a3] button 'Go'", None,
              "I should search for the chair."),
        state("t1", 1, f"{shop}/search?q=zephyr", "[b1] RootWebArea 'Search results for zephyr'\n"
              "[b7] link 'Zephyr Lounge Chair'\n[b8] link 'Zephyr Table Lamp'", "fill('a2', 'zephyr lounge chair')",
              "Open the chair."),
        state("t1", 2, f"{shop}/zephyr-lounge-chair.html", "[c1] RootWebArea 'Zephyr Lounge Chair'\n"
              f"[c2] heading 'Zephyr Lounge Chair'\n[c3] StaticText 'Price {FACT}'\n[c4] button 'Add to Cart'",
              "click('b7')", "The price is shown."),
        state("t1", 3, f"{shop}/checkout/cart", "[d1] RootWebArea 'Shopping Cart'\n[d2] StaticText 'Subtotal'",
              "click('c4')", "Added to the cart."),
        state("t1", 4, f"{shop}/checkout/cart", "[d1] RootWebArea 'Shopping Cart'", "send_msg_to_user('done')"),
    ]
    admin = "http://localhost:7780/admin"
    orders = [
        state("t2", 0, f"{admin}/dashboard", "[e1] RootWebArea 'Dashboard'\n[e2] link 'Sales'\n[e3] link 'Customers'",
              None),
        state("t2", 1, f"{admin}/sales/order", "[f1] RootWebArea 'Orders'\n[f2] gridcell 'Order #000178 Pending'",
              "click('e2')"),
        state("t2", 2, f"{admin}/sales/order/view/178", "[g1] RootWebArea 'Order #000178'\n[g2] button 'Ship'\n"
              "[g3] StaticText 'Status: Pending'", "click('f2')"),
        state("t2", 3, f"{admin}/sales/order/view/178", "[g1] RootWebArea 'Order #000178'\n"
              "[g3] StaticText 'Status: Processing'", "click('g2')"),
    ]
    forum = "http://localhost:9999"
    post = [
        state("t3", 0, f"{forum}/", "[h1] RootWebArea 'Postmill'\n[h2] link 'Submit'", None),
        state("t3", 1, f"{forum}/submit", "[i1] RootWebArea 'Create submission'\n[i2] textbox 'Title'\n"
              "[i3] button 'Create submission'", "click('h2')"),
        state("t3", 2, f"{forum}/submit", "[i1] RootWebArea 'Create submission'\n[i4] StaticText "
              "'You must wait 5 minutes between posts'", "click('i3')", "Blocked by the rate limit."),
        state("t3", 3, f"{forum}/", "[h1] RootWebArea 'Postmill'", "go_back()"),
    ]
    account = [
        state("t4", 0, f"{shop}/customer/account", "[j1] RootWebArea 'My Account'\n[j2] link 'Newsletter Subscriptions'",
              None),
        state("t4", 1, f"{shop}/newsletter/manage", "[k1] RootWebArea 'Newsletter Subscription'\n"
              "[k2] checkbox 'General Subscription'\n[k3] button 'Save'", "click('j2')"),
        state("t4", 2, f"{shop}/newsletter/manage", "[k1] RootWebArea 'Newsletter Subscription'\n"
              "[k2] checkbox 'General Subscription' checked", "check('k2')"),
        state("t4", 3, f"{shop}/customer/account", "[j1] RootWebArea 'My Account'\n"
              "[j3] StaticText 'We have saved your subscription.'", "click('k3')"),
    ]
    header = [("t1", "Find the price of the Zephyr Lounge Chair and add it to the cart", shop, "success", chair),
              ("t2", "Ship order #000178 in the admin panel", admin, "Task completed successfully.", orders),
              ("t3", "Post a new submission on the forum", forum, "failure: rate limited", post),
              ("t4", "Subscribe to the general newsletter", shop, "success", account)]
    return [{"id": tid, "domain": "web", "goal": goal, "start_url": url, "outcome": outcome, "states": states}
            for tid, goal, url, outcome, states in header]


def write_screenshots(root: Path, tid: str, n: int) -> None:
    (root / "screenshots" / tid).mkdir(parents=True, exist_ok=True)
    for k in range(n):
        (root / "screenshots" / tid / f"{k}.png").write_bytes(b"\x89PNG\r\n\x1a\n")


def well_formed(items: list[dict]) -> None:
    for item in items:
        assert set(item) == {"type", "value"} and item["type"] in ("text", "image")
        assert isinstance(item["value"], str) and item["value"].strip()
        if item["type"] == "image":
            assert Path(item["value"]).is_file()


def texts(items: list[dict]) -> str:
    return "\n".join(i["value"] for i in items if i["type"] == "text")


class ScriptedLLM:
    """Replies chosen by what the system prompt asks for; records every call."""

    def __init__(self, replies: dict[str, list[str]]):
        self.replies = {k: list(v) for k, v in replies.items()}
        self.calls: list[str] = []

    def complete(self, messages: list[dict]) -> str:
        system = messages[0]["content"]
        kind = ("repair" if system.startswith(REPAIR_PROMPT[:20]) else "notes" if system == NOTE_SYSTEM_PROMPT
                else "controller" if "retrieval queries" in system else "event" if "one step" in system else "insight")
        self.calls.append(kind)
        queue = self.replies.get(kind, [""])
        return queue.pop(0) if len(queue) > 1 else queue[0]


NOTES_JSON = json.dumps({"procedure_note": {"title": "Buy a chair in One Stop Market", "description": "How to buy.",
                                            "content": "- Search the product\n- Click Add to Cart"},
                         "hint_note": {"title": "Product page hints", "description": "Where prices are.",
                                       "content": ["Price is under the heading"]}})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lme")
    write_screenshots(path, "t1", 5)
    return path


@pytest.fixture(scope="module")
def rag(root):
    memory = make_memory("rag", MemoryOptions(root=root))
    for traj in make_trajectories():
        memory.insert(traj)
    memory.flush()
    return memory


def test_registry_names_and_unknown_name():
    for name in ("none", "rag", "rag_notes", "agentrunbook_r", "m2"):
        assert memory_class(name).name == name
    with pytest.raises(MemexError, match="unknown memory module 'nope'.*agentrunbook_r.*rag_notes"):
        make_memory("nope")
    assert make_memory("none").query("anything") == []
    with pytest.raises(MemexError, match="must be positive"):
        MemoryOptions(slice_top_k=0)


def test_slice_bounds_at_the_edges():
    assert slice_bounds(5, 0, 1) == (0, 2) and slice_bounds(5, 4, 1) == (3, 5) and slice_bounds(5, 2, 1) == (1, 4)
    assert slice_bounds(1, 0, 1) == (0, 1) and slice_bounds(5, 2, 0) == (2, 3)
    traj = simplify(make_trajectories()[0])
    entries = slice_entries(traj, radius=1, max_chars=40000)
    assert [(p["start"], p["end"]) for _, p in entries] == [(0, 2), (0, 3), (1, 4), (2, 5), (3, 5)]
    assert entries[0][0].startswith("State 0\n[a1] RootWebArea") and "\n\nState 1\n" in entries[0][0]
    assert len(slice_entries(traj, 1, max_chars=100)[2][0]) == 100


def test_transitions_annotate_elements_in_both_action_conventions():
    states = simplify(make_trajectories()[0])["states"]
    annotated = [a for _, a in transitions(states)]
    assert annotated[1] == "click('b7')  # [b7] link 'Zephyr Lounge Chair'"
    assert annotated[0].startswith("fill('a2', 'zephyr lounge chair')  # [a2] searchbox")
    shifted = [dict(s, action=n["action"]) for s, n in zip(states, states[1:])] + [dict(states[-1], action="")]
    assert [a for _, a in transitions(shifted)] == annotated


def test_rag_top_slice_holds_the_planted_fact(rag, root):
    items = rag.query("What was the price of the Zephyr Lounge Chair on its product page?")
    well_formed(items)
    assert items[0]["value"].startswith("## Retrieved Raw State Slices")
    assert sum(i["value"].startswith("### Raw state result") for i in items) == 6
    assert FACT in items[1]["value"] and "- Trajectory: t1" in items[1]["value"]
    assert "Full action sequence" in items[1]["value"] and "Local slice action sequence" in items[1]["value"]
    assert items[2]["type"] == "image" and items[2]["value"].startswith(str(root))
    assert not [i for i in items if i["type"] == "image" and "/t2/" in i["value"]]  # no file: no image item


def test_rag_save_load_gives_the_same_context(rag, root, tmp_path):
    question = "Which order was shipped in the admin panel?"
    rag.save(tmp_path / "rag")
    assert sorted(p.name for p in (tmp_path / "rag").iterdir()) == ["arrays.npz", "memory.json"]
    loaded = load_memory("rag", tmp_path / "rag", MemoryOptions(root=root))
    assert loaded.query(question) == rag.query(question)
    with pytest.raises(MemexError, match="rebuild"):
        load_memory("rag_notes", tmp_path / "rag", MemoryOptions(root=root))
    with pytest.raises(MemexError, match="rebuild"):
        load_memory("rag", tmp_path / "rag", MemoryOptions(root=root, slice_radius=2))
    with pytest.raises(MemexError, match="rebuild"):
        load_memory("rag", tmp_path / "missing", MemoryOptions())
    (tmp_path / "rag" / "arrays.npz").write_bytes(b"not an npz")
    with pytest.raises(MemexError, match="rebuild"):
        load_memory("rag", tmp_path / "rag", MemoryOptions(root=root))


def test_rag_notes_puts_notes_first_and_falls_back_on_garbage(root):
    llm = ScriptedLLM({"notes": ["```json\n" + NOTES_JSON + "\n```", "garbage"], "repair": ["still garbage"]})
    memory = make_memory("rag_notes", MemoryOptions(root=root, llm=llm))
    trajectories = make_trajectories()
    memory.insert(trajectories[0])
    memory.insert(trajectories[2])
    assert llm.calls == ["notes", "notes", "repair"]
    items = memory.query("How do I buy a chair?")
    well_formed(items)
    assert items[0]["value"].startswith("## Procedure and Hint Notes") and "- Note query: How do I buy a chair?" in items[0]["value"]
    assert "Title: Buy a chair in One Stop Market" in items[0]["value"] and "- Price is under the heading" in items[0]["value"]
    assert "Procedure fallback for Post a new submission" in items[0]["value"]  # the unreadable reply's fallback
    assert items[0]["value"].index("### Procedure note results") < items[0]["value"].index("### Hint note results")
    assert items[1]["value"].startswith("## Retrieved Raw State Slices")


def test_merge_budget_and_per_query_cap():
    def ranked(query: str, keys: str) -> list[Hit]:
        return [Hit(rank, 1.0 - rank / 10, {"id": key}, query) for rank, key in enumerate(keys, 1)]

    def keys(hits: list[Hit]) -> str:
        return "".join(h.key for h in hits)

    assert keys(merge_slice_hits([ranked("q", "abcdefgh")], 6, 2)) == "abcdef"
    assert keys(merge_slice_hits([ranked("q1", "abcdef"), ranked("q2", "abxyzw")], 6, 2)) == "abcxyz"
    assert keys(merge_slice_hits([ranked("q1", "abc"), ranked("q2", "ade"), ranked("q3", "fgh")], 6, 2)) == "abdefg"
    five = merge_slice_hits([ranked(f"q{i}", f"{c}{c.upper()}z") for i, c in enumerate("abcde")], 6, 2)
    assert keys(five) == "aAbBcCdDeE"  # 4-5 queries: the cap, not trimmed to the budget (as the real module)
    assert keys(merge_slice_hits([ranked("q", "aa"), ranked("r", "ab")], 2, 2)) == "ab" and merge_slice_hits([]) == []
    assert [h.query for h in merge_slice_hits([ranked("q1", "ab"), ranked("q2", "ac")])] == ["q1", "q1", "q2"]


def test_controller_reply_parsing():
    good = '{"raw_state_queries": ["cart  page", "cart page", "a", "b", "c", "d", "e"], "event_query": "x"}'
    assert parse_query_bundle(good) == {"raw_state_queries": ["cart page", "a", "b", "c", "d"], "event_query": "x",
                                        "note_query": ""}
    fenced = 'Sure:\n```json\n{"raw_state_queries": [], "event_query": "", "note_query": "how to ship"}\n```'
    assert parse_query_bundle(fenced)["note_query"] == "how to ship"
    for bad in ("no json here", '{"raw_state_queries": "one"}', '["a"]', ""):
        with pytest.raises(ValueError):
            parse_query_bundle(bad)
    assert fallback_bundle(" Why  so? ") == {"raw_state_queries": ["Why so?"], "event_query": "Why so?",
                                             "note_query": "Why so?"}


def test_agentrunbook_r_renders_notes_events_slices(root):
    bundle = json.dumps({"raw_state_queries": ["order status after shipping", "Ship button"],
                         "event_query": "click Ship and the status changes", "note_query": "ship an order"})
    event = json.dumps({"overview": "Shipping order 178.", "state_transition": "Status went from Pending to Processing."})
    llm = ScriptedLLM({"controller": [bundle, "garbage"], "event": [event], "notes": [NOTES_JSON]})
    memory = make_memory("agentrunbook_r", MemoryOptions(root=root, llm=llm,
                                                         extra={"max_events_per_trajectory": 2}))
    for traj in make_trajectories()[:2]:
        memory.insert(traj)
    assert llm.calls.count("event") == 4 and llm.calls.count("notes") == 2  # 2 of t1's 4 transitions, 2 of t2's 3
    items = memory.query("After clicking Ship on order #000178, what status does it show?")
    well_formed(items)
    heads = [i["value"].split("\n")[0] for i in items if i["type"] == "text" and i["value"].startswith("## ")]
    assert heads == ["## Procedure and Hint Notes Learned from Previous Tasks in the Environment",
                     "## Retrieved State-Transition Events from Previous Tasks in the Environment",
                     "## Retrieved Raw State Slices from Previous Tasks in the Environment"]
    body = texts(items)
    assert "- Note query: ship an order" in body and "- Event query: click Ship and the status changes" in body
    assert "Status went from Pending to Processing." in body and "Goal recap: Ship order #000178" in body
    assert sum(i["value"].startswith("### Raw state result") for i in items) == 6  # 2 queries: 3 each
    assert sum(i["value"].startswith("### Event result") for i in items) == 6
    assert any(i["type"] == "image" and "/t1/" in i["value"] for i in items)
    fallback = memory.query("Which status?")  # the controller's garbage (and its repair) -> the question everywhere
    assert "- Note query: Which status?" in texts(fallback) and "- Event query: Which status?" in texts(fallback)
    assert llm.calls[-2:] == ["controller", "repair"]


def test_agentrunbook_r_without_llm_uses_rule_made_entries(root, tmp_path):
    memory = make_memory("agentrunbook_r", MemoryOptions(root=root))
    for traj in make_trajectories():
        memory.insert(traj)
    items = memory.query("What blocked the forum submission?")
    well_formed(items)
    assert "wait 5 minutes" in texts(items)
    memory.save(tmp_path / "arr")
    again = load_memory("agentrunbook_r", tmp_path / "arr", MemoryOptions(root=root))
    assert again.query("What blocked the forum submission?") == items


def test_m2_distils_successful_trajectories(tmp_path):
    assert succeeded("success") and succeeded("Task completed successfully.") and succeeded(True)
    assert not succeeded("failure: rate limited") and not succeeded(None) and not succeeded("not completed")
    assert step_text("click('b7')  # [b7] link 'Zephyr Lounge Chair'") == "click link 'Zephyr Lounge Chair'"
    assert step_text("fill('a2', 'zephyr')  # [a2] searchbox 'Search'") == "fill searchbox 'Search'"
    assert step_text("scroll(0, 300)") is None
    insight = distill(simplify(make_trajectories()[1]))
    assert insight.startswith("Ship order #000178 in the admin panel: start at http://localhost:7780/admin;")
    assert "click link 'Sales' -> click gridcell 'Order #000178 Pending' -> click button 'Ship'" in insight
    assert "e2" not in insight
    memory = make_memory("m2", MemoryOptions())
    for traj in make_trajectories():
        memory.insert(traj)
    assert [p["tid"] for p in memory.pools["insights"].payloads] == ["t1", "t2", "t4"]  # t3 failed
    items = memory.query("How do I subscribe to the newsletter?")
    well_formed(items)
    assert len(items) == 1 and items[0]["value"].startswith("## Insights from Similar Successful Tasks")
    assert items[0]["value"].split("\n1. ")[1].startswith("Subscribe to the general newsletter")
    memory.save(tmp_path / "m2")
    assert load_memory("m2", tmp_path / "m2", MemoryOptions()).query("How do I subscribe?") == memory.query(
        "How do I subscribe?")
    llm = ScriptedLLM({"insight": ["- Use the account menu\n- Verify the saved message"]})
    written = make_memory("m2", MemoryOptions(llm=llm))
    written.insert(make_trajectories()[3])
    assert written.pools["insights"].payloads[0]["insight"].endswith("- Verify the saved message")


def test_endpoint_embedder_batches_prefixes_queries_and_normalises():
    class FakeEmbeddings:
        def __init__(self):
            self.calls = []

        def create(self, model, input):
            self.calls.append((model, list(input)))
            return SimpleNamespace(data=[SimpleNamespace(embedding=[3.0, 4.0]) for _ in input])

    embedder = make_embedder(MemoryOptions(embedder="http://localhost:8114/v1", embed_batch=2,
                                           extra={"embedding_model": "emb-model"}))
    fake = FakeEmbeddings()
    embedder._client = SimpleNamespace(embeddings=fake)
    vectors = embedder.documents(["a", "b", "c"])
    assert vectors.shape == (3, 2) and abs(float(vectors[0] @ vectors[0]) - 1.0) < 1e-6
    assert [len(batch) for _, batch in fake.calls] == [2, 1] and fake.calls[0][0] == "emb-model"
    embedder.queries(["where is Save?"])
    assert fake.calls[-1][1] == [f"Instruct: {PAPER_QUERY_INSTRUCTION}\nQuery:where is Save?"]
    assert embedder.name == "http://localhost:8114/v1#emb-model"


@pytest.mark.slow
def test_rag_notes_with_a_real_local_llm(root):
    from eval.lme.llm import make_chat

    llm = make_chat("local", max_new_tokens=32)
    memory = make_memory("rag_notes", MemoryOptions(root=root, llm=llm, extra={"note_state_chars": 200}))
    memory.insert(make_trajectories()[0])
    items = memory.query("What was the price of the Zephyr Lounge Chair?")
    well_formed(items)
    assert items[0]["value"].startswith("## Procedure and Hint Notes") and FACT in texts(items)
