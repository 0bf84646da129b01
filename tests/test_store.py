"""Tests of the experience store (memory/store.py) and its benchmark (eval/bench_store.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import hashlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.errors import MemexError
from eval.bench_store import bench_store, format_bench_store
from memory.store import (
    Block,
    BlockWrite,
    ExperienceStore,
    InMemoryStore,
    SQLiteStore,
    is_valid_index,
    open_store,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    s = open_store(request.param, str(tmp_path / "store.db"))
    yield s
    s.close()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_is_valid_index():
    assert is_valid_index("a")
    assert is_valid_index("apple_2-loc")
    assert is_valid_index("x" * 64)
    for bad in ["", "x" * 65, "has space", "dot.dot", "ünï", "a\n", None, 3]:
        assert not is_valid_index(bad)


def test_round_trip_and_metadata(store):
    block = store.write("fridge_1", "apple 2, egg 1", step=3, mode="anchor", description="fridge contents")
    assert block == store.read("fridge_1")
    assert block.content == "apple 2, egg 1"
    assert block.sha256 == sha("apple 2, egg 1")
    assert (block.step, block.mode, block.version, block.supersedes) == (3, "anchor", 1, None)
    assert block.description == "fridge contents"
    assert store.read("missing") is None
    assert store.read("not valid!") is None
    assert "fridge_1" in store and "missing" not in store and len(store) == 1


def test_rewrite_versions_and_history(store):
    store.write("plan", "v1", step=1)
    store.write("other", "x", step=2)
    store.write("plan", "v2", step=5)
    third = store.write("plan", "v3 ünïcode", step=9)
    assert (third.version, third.supersedes, third.step) == (3, 2, 9)
    assert third.sha256 == sha("v3 ünïcode")
    assert store.read("plan") == third
    history = store.history("plan")
    assert [b.content for b in history] == ["v1", "v2", "v3 ünïcode"]
    assert [(b.version, b.supersedes) for b in history] == [(1, None), (2, 1), (3, 2)]
    assert store.history("nothing") == []
    assert store.indices() == ["plan", "other"]  # order of first write, not of last
    assert store.as_dict() == {"plan": "v3 ünïcode", "other": "x"}
    assert len(store) == 2


def test_write_many_returns_blocks_in_order(store):
    blocks = store.write_many([BlockWrite("a", "1"), BlockWrite("b", "2", "anchor", "bee")], step=4)
    assert [b.index for b in blocks] == ["a", "b"]
    assert blocks[1] == Block("b", "2", 4, "anchor", sha("2"), 1, None, "bee")
    assert store.write_many([], step=5) == []


@pytest.mark.parametrize(
    "bad",
    [
        [BlockWrite("ok", "x"), BlockWrite("bad index", "y")],
        [BlockWrite("ok", "x"), BlockWrite("dup", "y"), BlockWrite("dup", "z")],
        [BlockWrite("ok", "x"), BlockWrite("m", "y", mode="verbatim")],
        [BlockWrite("ok", "x"), BlockWrite("x" * 65, "y")],
    ],
)
def test_invalid_write_is_atomic(store, bad):
    store.write("ok", "before", step=0)
    with pytest.raises(MemexError):
        store.write_many(bad, step=1)
    assert store.as_dict() == {"ok": "before"}
    assert len(store.history("ok")) == 1


def test_failure_inside_transaction_rolls_back(store, monkeypatch):
    store.write("keep", "v1", step=0)
    original = type(store)._insert

    def half_insert(self, blocks):
        original(self, blocks[:1])
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(type(store), "_insert", half_insert)
    with pytest.raises(RuntimeError):
        store.write_many([BlockWrite("keep", "v2"), BlockWrite("new", "n")], step=1)
    monkeypatch.undo()
    if isinstance(store, SQLiteStore):  # a transaction undoes the half write; the dict has no transaction
        assert store.as_dict() == {"keep": "v1"}
        assert store.write("keep", "v2", step=2).version == 2


def test_bad_step_rejected(store):
    for step in [-1, 1.5, "3", True]:
        with pytest.raises(MemexError):
            store.write("a", "x", step=step)
    assert len(store) == 0


def test_suggest_logs_no_line_per_index_it_builds(store, caplog):
    """bm25s sets its own logger to DEBUG: a reading episode's logs were a 'Building index' line a turn."""
    caplog.set_level("DEBUG")
    store.write("fridge_1_contents", "apple 2, egg 1", step=1)
    store.write("countertop_items", "knife 1, bread 1", step=2)
    assert store.suggest("knife") == ["countertop_items"]
    assert not [r for r in caplog.records if r.name.startswith("bm25s")]


def test_suggest(store):
    assert store.suggest("fridge") == []
    store.write("fridge_1_contents", "apple 2, egg 1, lettuce 1", step=1, description="what is in the fridge")
    assert store.suggest("fridge") == ["fridge_1_contents"]  # one-document corpus
    assert store.suggest("zebra") == []
    store.write("countertop_items", "knife 1, bread 1", step=2, description="kitchen counter objects")
    store.write("task_plan", "heat the apple then put it in the garbage can", step=2)
    store.write("sinkbasin_obs", "", step=3)  # empty content must not break indexing
    assert store.suggest("fridge_contents")[0] == "fridge_1_contents"
    assert store.suggest("where is the knife")[0] == "countertop_items"
    assert store.suggest("Eggs") == ["fridge_1_contents"]  # case and plural
    assert store.suggest("the of and") == []  # only stopwords
    assert len(store.suggest("apple knife plan", k=2)) == 2
    assert store.suggest("apple", k=0) == []
    for hits in (store.suggest("fridge stuff", k=10), store.suggest("plan")):
        assert "fridge stuff" not in hits and set(hits) <= set(store.indices())
    # the index is rebuilt after a rewrite
    store.write("task_plan", "cool the lettuce", step=4)
    assert set(store.suggest("lettuce")) == {"fridge_1_contents", "task_plan"}
    assert store.suggest("garbage") == []


def test_context_manager_closes(tmp_path):
    with SQLiteStore(tmp_path / "c.db") as s:
        s.write("a", "x", step=0)
    with pytest.raises(MemexError, match="closed"):
        s.read("a")
    with InMemoryStore() as m:
        m.write("a", "x", step=0)


@settings(max_examples=30, deadline=None)
@given(
    writes=st.lists(
        st.tuples(st.sampled_from(["a", "b-1", "c_2", "D"]), st.text(max_size=30)), min_size=0, max_size=12
    )
)
def test_backends_agree_with_a_dict_model(tmp_path_factory, writes):
    model: dict[str, list[str]] = {}
    db = tmp_path_factory.mktemp("hyp") / "h.db"
    with InMemoryStore() as mem, SQLiteStore(db) as sql:
        for step, (index, content) in enumerate(writes):
            for s in (mem, sql):
                s.write(index, content, step=step)
            model.setdefault(index, []).append(content)
        for s in (mem, sql):
            assert s.as_dict() == {k: v[-1] for k, v in model.items()}
            assert s.indices() == list(model)
            for k, v in model.items():
                assert [b.content for b in s.history(k)] == v
        assert [mem.history(k) for k in model] == [sql.history(k) for k in model]


# --- SQLite-specific ----------------------------------------------------------------------------------


def test_sqlite_reopen_returns_same_blocks(tmp_path):
    path = tmp_path / "mem.db"
    with SQLiteStore(path) as s:
        s.write("a", "first", step=1, description="d")
        s.write_many([BlockWrite("b", "bee", "anchor"), BlockWrite("a", "second")], step=2)
        before = {k: s.history(k) for k in s.indices()}
    with SQLiteStore(str(path)) as s:
        assert {k: s.history(k) for k in s.indices()} == before
        assert s.indices() == ["a", "b"]
        assert s.write("a", "third", step=3).version == 3
    with SQLiteStore(path) as s:
        assert s._db().execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_sqlite_namespaces_are_separate(tmp_path):
    path = tmp_path / "shared.db"
    with SQLiteStore(path, "haystack_1") as h1, SQLiteStore(path, "haystack_2") as h2:
        h1.write("x", "one", step=0)
        h2.write("x", "two", step=0)
        h2.write("x", "two again", step=1)
        h2.write("y", "only two", step=1)
        assert h1.as_dict() == {"x": "one"} and h1.read("x").version == 1
        assert h2.as_dict() == {"x": "two again", "y": "only two"}
        assert "y" not in h1 and h1.suggest("only") == []
    with SQLiteStore(path) as default:
        assert len(default) == 0


def test_sqlite_bad_paths(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is definitely not a database, just some text " * 100)
    with pytest.raises(MemexError, match="junk.db.*not a usable SQLite"):
        SQLiteStore(junk)
    with pytest.raises(MemexError, match="does not exist"):
        SQLiteStore(tmp_path / "no" / "such" / "dir.db")
    with pytest.raises(MemexError, match="needs a path"):
        open_store("sqlite")
    with pytest.raises(MemexError, match="unknown"):
        open_store("redis")
    with pytest.raises(MemexError):
        SQLiteStore(tmp_path / "x.db", namespace="")


def test_sqlite_foreign_table_rejected(tmp_path):
    import sqlite3

    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE memex_blocks (a TEXT)")
    conn.close()
    with pytest.raises(MemexError, match="columns"):
        SQLiteStore(path)


def test_open_store_types(tmp_path):
    assert isinstance(open_store("memory"), InMemoryStore)
    s = open_store("sqlite", str(tmp_path / "o.db"), namespace="ns")
    assert isinstance(s, SQLiteStore) and isinstance(s, ExperienceStore) and s.namespace == "ns"
    s.close()


CHILD = textwrap.dedent(
    """
    import sys
    from memory.store import SQLiteStore

    store = SQLiteStore(sys.argv[1], namespace="durable")
    for i in range(1_000_000):
        index = f"block_{i}"
        store.write(index, f"content of {index} " * 20, step=i)
        print(f"committed {index}", flush=True)
    """
)


def test_sqlite_durability_under_sigkill(tmp_path):
    """Every write reported as returned survives a SIGKILL of the writer in mid-stream."""
    path = tmp_path / "durable.db"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    committed = []
    try:
        while len(committed) < 50:
            line = child.stdout.readline()
            if not line:
                pytest.fail(f"writer exited early: {child.stderr.read()}")
            assert line.startswith("committed ")
            committed.append(line.split()[1])
        child.send_signal(signal.SIGKILL)
        # Lines printed between our last read and the kill are committed too.
        committed += [line.split()[1] for line in child.stdout if line.startswith("committed ")]
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL  # killed while still writing, not finished
    with SQLiteStore(path, namespace="durable") as store:
        for index in committed:
            block = store.read(index)
            assert block is not None, f"{index} was reported committed but is gone"
            assert block.content == f"content of {index} " * 20
            assert block.sha256 == sha(block.content)
        assert len(store) >= len(committed)


def test_bench_store_small(tmp_path):
    result = bench_store(n_blocks=50, content_chars=100, tmp_dir=str(tmp_path))
    assert set(result) == {"memory", "sqlite", "ratio_sqlite_over_memory"}
    for key in result:
        assert set(result[key]) == {"writes_per_s", "reads_per_s"}
        assert all(v > 0 for v in result[key].values())
    table = format_bench_store(result)
    assert "memory" in table and "sqlite/memory" in table and len(table.splitlines()) == 4
