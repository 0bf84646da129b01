"""`memexrl lme catalog-recall` (eval/lme/catalog_recall.py): what the memex catalog's first k blocks reach."""

import json

import pytest

from common.errors import MemexError
from eval.lme.catalog_recall import catalog_recall
from eval.lme.data import load_lme
from eval.lme.harness import evidence_strings, group_key
from eval.lme.memory.memex import BLOCKS, QUERY_EPISODES_FILE, STORE_FILE
from eval.lme.synth import write_synthetic
from memexrl.cli import main
from memory.store import BlockWrite, SQLiteStore


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("lme") / "data"
    write_synthetic(root, seed=0, n_trajectories_small=8, n_trajectories_medium=12, questions_per_type=1)
    return root


def test_every_page_archived_holds_every_planted_string_and_more_reads_reach_more(dataset):
    result = catalog_recall(dataset, "small", None, [1, 2, 3, 50], rank_chars=0)
    rows = result["rows"]
    assert rows["archive"][0] == 1.0  # each planted string is on some page
    recalls = [rows[k][0] for k in (1, 2, 3, 50)]
    chars = [rows[k][2] for k in (1, 2, 3, 50)]
    assert recalls == sorted(recalls) and chars == sorted(chars) and chars[0] > 0
    assert rows[50][0] == 1.0  # the whole small archive fits in 50 blocks


def test_an_eval_archive_is_ranked_by_the_question(dataset, tmp_path, capsys):
    data = load_lme(dataset)
    strings = evidence_strings(dataset)
    (ids, questions), *_ = data.haystack_groups("small")
    asked = next(q for q in questions if strings.get(q.id))
    store_dir = tmp_path / "eval" / "memory_state" / group_key(0, questions)
    store_dir.mkdir(parents=True)
    with SQLiteStore(store_dir / STORE_FILE, BLOCKS) as store:
        # The block holding the evidence is archived last, so only the question's ranking can put it first.
        store.write_many([BlockWrite(f"t000{i}-other", "a page about nothing asked", "explicit", f"- page {i}")
                          for i in range(4)], step=0)
        store.write_many([BlockWrite("t0009-answer", " ".join(strings[asked.id]), "explicit",
                                     f"- t0009-answer: {asked.question}")], step=1)
    n = sum(1 for q in questions if strings.get(q.id))
    result = catalog_recall(dataset, "small", tmp_path / "eval", [1], rank_chars=200)
    assert result["questions"] == n and result["rows"][1][0] == pytest.approx(1 / n)
    main(["lme", "catalog-recall", "--data", str(dataset), "--archive", str(tmp_path / "eval"), "--k", "1"])
    out = capsys.readouterr().out
    assert f"| first 1 | {1 / n:.2f} |" in out and "| the controller" not in out
    assert "no query episodes" in out  # this archive was saved without the work/ directory of its questions
    assert "never archived" not in out


def test_the_controllers_own_reads_and_where_each_miss_lost_its_evidence(dataset, tmp_path, capsys):
    data = load_lme(dataset)
    strings = evidence_strings(dataset)
    (ids, questions), *_ = data.haystack_groups("small")
    asked = [q for q in questions if len(strings.get(q.id, [])) >= 2][:2]
    whole, half = asked
    others = [q for q in questions if strings.get(q.id) and q not in asked]
    key = group_key(0, questions)
    (tmp_path / "memory_state" / key).mkdir(parents=True)
    with SQLiteStore(tmp_path / "memory_state" / key / STORE_FILE, BLOCKS) as store:
        store.write_many([BlockWrite("all", " ".join(strings[whole.id]), "explicit", "- all"),
                          BlockWrite("first", strings[half.id][0], "explicit", "- first"),
                          BlockWrite("rest", " ".join(strings[half.id][1:]), "explicit", "- rest"),
                          BlockWrite("noise", "nothing asked", "explicit", "- noise")], step=0)
    (tmp_path / "work" / key).mkdir(parents=True)
    episodes = [{"question": whole.question, "read": ["all"]},  # every string read
                {"question": half.question, "read": ["first"]}]  # archived, partly read
    episodes += [{"question": q.question, "read": ["noise"]} for q in others]  # none read, or never archived
    (tmp_path / "work" / key / QUERY_EPISODES_FILE).write_text("".join(json.dumps(e) + "\n" for e in episodes))
    result = catalog_recall(dataset, "small", tmp_path, [1], rank_chars=0)
    n = 2 + len(others)
    assert result["rows"]["reads"][0] == pytest.approx(1 / n) and result["distinct_reads"] == 1.0
    assert result["misses"] == {"archived, partly read": 1, "a string never archived": len(others)}
    main(["lme", "catalog-recall", "--data", str(dataset), "--archive", str(tmp_path), "--k", "1", "--rank-chars", "0"])
    out = capsys.readouterr().out
    assert f"| the controller's reads (1.00 distinct a question) | {1 / n:.2f} |" in out
    assert (f"{len(others)} a string never archived, 0 archived, none of it read, 1 archived, partly read, "
            "0 never asked") in out
    # a question the controller read nothing for, although its strings are archived; the others were not asked
    (tmp_path / "work" / key / QUERY_EPISODES_FILE).write_text(json.dumps({"question": whole.question, "read": []}))
    misses = catalog_recall(dataset, "small", tmp_path, [1], rank_chars=0)["misses"]
    assert misses == {"archived, none of it read": 1, "never asked": n - 1}


def test_bad_input_stops_with_what_to_fix(dataset, tmp_path, capsys):
    with pytest.raises(MemexError, match="eval lme --memory memex"):
        catalog_recall(dataset, "small", tmp_path, [1], rank_chars=200)  # no memory_state/ there
    with pytest.raises(MemexError, match="lme synth"):  # real LME-V2 data plants no strings to look for
        catalog_recall(tmp_path, "small", None, [1], rank_chars=200)
    assert main(["lme", "catalog-recall", "--data", str(dataset)]) == 2
    assert "--archive DIR" in capsys.readouterr().err
    (ids, questions), *_ = load_lme(dataset).haystack_groups("small")
    key = group_key(0, questions)
    (tmp_path / "memory_state" / key).mkdir(parents=True)
    SQLiteStore(tmp_path / "memory_state" / key / STORE_FILE, BLOCKS).close()
    (tmp_path / "work" / key).mkdir(parents=True)
    (tmp_path / "work" / key / QUERY_EPISODES_FILE).write_text('{"question": "q", "read": ["a"]}\n{"question": "q"\n')
    with pytest.raises(MemexError, match=f"{QUERY_EPISODES_FILE}:2 is not a question episode"):
        catalog_recall(dataset, "small", tmp_path, [1], rank_chars=0)
