"""`memexrl eval lme` end to end on a synthetic LME-V2 data set with the local reader (eval/lme/harness.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402

import pytest  # noqa: E402

from eval.lme.memory.rag import RagMemory  # noqa: E402
from eval.lme.metrics import AGGREGATED_FILE, PER_QUESTION_FIELDS, PER_QUESTION_FILE  # noqa: E402
from eval.lme.reader import ContextCounter, truncate_items  # noqa: E402
from eval.lme.synth import write_synthetic  # noqa: E402
from memexrl.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("lme") / "data"
    write_synthetic(root, seed=0, n_trajectories_small=8, n_trajectories_medium=12, questions_per_type=1)
    return root


def rows_of(out):
    return [json.loads(line) for line in (out / PER_QUESTION_FILE).read_text().splitlines()]


def test_truncation_keeps_the_longest_prefix_of_whole_items(smol_tokenizer):
    counter = ContextCounter(smol_tokenizer)
    items = [{"type": "text", "value": f"item {i}: " + "word " * 50} for i in range(6)]
    full = counter.count(items)
    kept, original, final = truncate_items(items, counter, max_tokens=full - 1)
    assert original == full and kept == items[:5] and final == counter.count(items[:5]) <= full - 1
    assert truncate_items(items, counter, max_tokens=full) == (items, full, full)
    assert truncate_items(items, counter, max_tokens=3)[0] == []



def test_a_text_only_reader_counts_an_image_as_the_placeholder_it_is_given(smol_tokenizer):
    text = {"type": "text", "value": "The store currency is EUR."}
    image = {"type": "image", "value": "screens/state_3.png"}
    placeholder = {"type": "text", "value": "\n[image: state_3.png]\n"}
    assert ContextCounter.text_only(smol_tokenizer).count([text, image]) == ContextCounter(smol_tokenizer).count(
        [text, placeholder])
    assert ContextCounter(smol_tokenizer, image_tokens=1024).count([text, image]) == (
        ContextCounter(smol_tokenizer).count([text]) + 1024)  # a multimodal budget without its processor


@pytest.mark.slow
def test_eval_lme_runs_scores_and_resumes(dataset, tmp_path, capsys, monkeypatch):
    out = tmp_path / "rag"
    args = ["eval", "lme", "--data", str(dataset), "--haystack", "small", "--memory", "rag", "--judge", "local",
            "--questions", "3", "--local-max-new-tokens", "24", "--out", str(out), "--api-key", "sk-never-written",
            "--max-context-tokens", "1500"]  # a small reader budget: each reader call prefills ~2,000 tokens, not ~7,400
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert not [p for p in out.rglob("*") if p.is_file() and b"sk-never-written" in p.read_bytes()]
    assert "small / rag: accuracy" in printed and "of 3 questions" in printed
    rows = rows_of(out)
    assert len(rows) == 3 and all(set(PER_QUESTION_FIELDS) <= set(r) for r in rows)
    for r in rows:
        assert r["memory_context"] and r["memory_query_duration_seconds"] > 0
        assert r["memory_context_token_count"] <= min(1500, r["memory_context_original_token_count"])
        assert r["score"] in (0.0, 1.0) and r["response_raw"] is not None
        # the reader's own usage (not the judge's): its prompt holds the memory context it was given
        u = r["usage"]
        assert u["prompt_tokens"] > r["memory_context_token_count"] and 0 < u["completion_tokens"] <= 24
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    aggregated = json.loads((out / AGGREGATED_FILE).read_text())
    assert aggregated["overall"]["count_all_questions"] == 3
    assert aggregated["tokens"]["prompt_tokens"] == sum(r["usage"]["prompt_tokens"] for r in rows)
    assert aggregated["memory_query"]["avg_seconds"] > 0
    # The synthetic set's planted answers: rag's slices carry them into the context (a diagnostic of ours).
    assert 0 < aggregated["evidence_recall"] <= 1 and all(isinstance(r["evidence_in_context"], bool) for r in rows)
    assert all(r["evidence_in_context"] == (r["evidence_share"] == 1.0) for r in rows)  # all strings vs their share
    assert aggregated["evidence_recall"] <= aggregated["evidence_string_recall"] == pytest.approx(
        sum(r["evidence_share"] for r in rows) / len(rows))
    assert sorted(p.parent.name for p in (out / "memory_state").glob("*/DONE")) == ["group000-web", "group001-enterprise"]
    # Interrupted in the middle of writing the third row: a rerun answers it again and keeps the others. It loads the
    # saved memory, whose model starts in warm_up, before the question it times.
    lines = (out / PER_QUESTION_FILE).read_text().splitlines()
    (out / PER_QUESTION_FILE).write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    calls = []
    monkeypatch.setattr(RagMemory, "warm_up", lambda self, f=RagMemory.warm_up: calls.append("warm_up") or f(self))
    monkeypatch.setattr(RagMemory, "query", lambda self, *a, f=RagMemory.query: calls.append("query") or f(self, *a))
    assert main(args) == 0
    assert calls == ["warm_up", "query"]
    again = rows_of(out)
    assert [r["question_id"] for r in again] == [r["question_id"] for r in rows]
    assert again[:2] == rows[:2]


def test_bad_input_is_one_clear_line(dataset, tmp_path, capsys, caplog):
    assert main(["eval", "lme", "--data", str(tmp_path / "missing"), "--haystack", "small", "--memory", "none",
                 "--out", str(tmp_path / "o")]) == 2
    assert "memexrl lme synth" in capsys.readouterr().err
    assert main(["eval", "lme", "--data", str(dataset), "--haystack", "small", "--memory", "nope",
                 "--out", str(tmp_path / "o")]) == 2
    assert "unknown memory module 'nope'" in capsys.readouterr().err
    # a memex controller's bad config stops before the reader and the judge load (no "loaded" log line)
    caplog.set_level("INFO")
    assert main(["eval", "lme", "--data", str(dataset), "--haystack", "small", "--memory", "memex",
                 "--out", str(tmp_path / "o"), "rollout.temperature=-1"]) == 2
    captured = capsys.readouterr()
    assert "rollout.temperature" in captured.err and "loaded" not in caplog.text
