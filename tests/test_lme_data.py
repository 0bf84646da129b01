"""The LME-V2 loader (eval/lme/data.py) and the synthetic data set (eval/lme/synth.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from common.errors import MemexError  # noqa: E402
from envs.lme_records import state_text  # noqa: E402
from eval.lme.data import QUESTION_TYPES, load_lme  # noqa: E402
from eval.lme.scoring import DEFAULT_SEPARATORS, normalize, parse_eval_function  # noqa: E402
from eval.lme.synth import EVIDENCE_FILE, synth_command, write_synthetic  # noqa: E402

EVAL_NAMES = {"norm_phrase_set_match", "norm_phrase_set_match_ordered", "mc_choice_match", "mc_choice_set_match",
              "llm_abstention_checker", "llm_gotchas_checker"}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("lme") / "data"
    summary = write_synthetic(root, seed=0)
    return root, summary, load_lme(root), json.loads((root / EVIDENCE_FILE).read_text())


def _is_subsequence(small: list[str], medium: list[str]) -> bool:
    it = iter(medium)
    return all(t in it for t in small)


def test_round_trip_covers_the_schema(synth):
    root, summary, data, evidence = synth
    assert summary["questions"] == 21 and summary["trajectories"] == 60 and summary["bytes"] < 5e6
    assert {q.question_type for q in data.questions} == set(QUESTION_TYPES)
    assert {parse_eval_function(q.eval_function)[0] for q in data.questions} == EVAL_NAMES
    assert any("separators" in q.eval_function for q in data.questions)
    assert any(q.image for q in data.questions) and all(Path(q.image).is_file() for q in data.questions if q.image)
    assert {q.domain for q in data.questions} == {"web", "enterprise"}
    assert list(data.trajectories) == [json.loads(line)["id"] for line in (root / "trajectories.jsonl").open()]
    small, medium = data.haystack("small"), data.haystack("medium")
    assert sum(map(len, {tuple(v) for v in small.values()})) == 24
    assert sum(map(len, {tuple(v) for v in medium.values()})) == 60
    assert data.shared_haystack(small) is None  # a haystack holds its question's domain only
    for dom in data.domains():
        s, m = data.shared_haystack(small, dom), data.shared_haystack(medium, dom)
        assert s and m and len(s) < len(m) and _is_subsequence(s, m)
        assert all(data.trajectories[t]["domain"] == dom for t in m)
    groups = data.haystack_groups("medium")
    assert len(groups) == 2 and sum(len(qs) for _, qs in groups) == 21
    assert [q.id for q in data.questions_in("small")] == [q.id for q in data.questions]
    for q in data.questions:
        ev = evidence[q.id]["trajectories"]
        assert 1 <= len(ev) <= 2 and set(ev) <= set(small[q.id]) and set(ev) <= set(medium[q.id])
    for t in data.trajectories.values():
        assert t["states"][-1]["action"] is None and all(s["action"] for s in t["states"][:-1])
        for k, s in enumerate(t["states"]):
            assert s["screenshot"] == f"screenshots/{t['id']}/{k}.png" and (root / s["screenshot"]).is_file()
            assert 8 <= len(state_text(s).splitlines()) <= 25
            bid = re.match(r"\w+\('(a\d+)'", s["action"] or "")
            assert bid is None or f"[{bid.group(1)}] " in state_text(s)  # an action names an element there


def _options(question: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-H])\) (.+)$", question, flags=re.M))


def test_gold_answers_are_in_the_evidence_states(synth):
    _, _, data, evidence = synth
    for q in data.questions:
        ev = evidence[q.id]
        for tid, k, needle in ev["needles"]:
            assert needle in state_text(data.trajectories[tid]["states"][k]), (q.id, needle)
        text = normalize(" ".join(state_text(data.trajectories[t]["states"][k]) for t, k in ev["states"]))
        name, options = parse_eval_function(q.eval_function)
        if name.startswith("norm_phrase_set_match"):
            seps = options.get("separators", DEFAULT_SEPARATORS)
            phrases = [normalize(p) for p in re.split("|".join(map(re.escape, seps)), q.answer) if normalize(p)]
            assert phrases and all(re.search(rf"\b{re.escape(p)}\b", text) for p in phrases), (q.id, phrases)
        elif name.startswith("mc_choice"):
            opts = _options(q.question)
            gold = [opts[letter] for letter in re.findall(r"[A-H]", q.answer)]
            assert gold and all(normalize(g) in text for g in gold), (q.id, gold)
        if q.question_type == "dynamic-environment":  # the later trajectory holds the current value
            before, after = ev["trajectories"]
            order = data.haystack("small")[q.id]
            assert order.index(before) < order.index(after)
            current = normalize(_options(q.question)[q.answer] if name == "mc_choice_match" else
                                re.split("[;,]", q.answer)[-1])
            seen = {t: normalize(" ".join(state_text(data.trajectories[t]["states"][k])
                                          for t2, k in ev["states"] if t2 == t)) for t in (before, after)}
            assert re.search(rf"\b{current}\b", seen[after]) and not re.search(rf"\b{current}\b", seen[before])


def test_procedure_answer_is_the_click_path(synth):
    _, _, data, evidence = synth
    for q in data.questions:
        if parse_eval_function(q.eval_function)[0] != "norm_phrase_set_match_ordered" or q.question_type != "procedure":
            continue
        (tid,) = evidence[q.id]["trajectories"]
        clicked = []
        for s in data.trajectories[tid]["states"]:
            m = re.match(r"click\('(a\d+)'\)", s["action"] or "")
            if m:
                clicked.append(re.search(rf"\[{m.group(1)}\] \w+ '([^']*)'", state_text(s)).group(1))
        sep = parse_eval_function(q.eval_function)[1].get("separators", DEFAULT_SEPARATORS)
        path = [p.strip() for p in re.split("|".join(map(re.escape, sep)), q.answer)]
        assert _is_subsequence(path, clicked), (q.id, path, clicked)


def test_synth_is_deterministic_per_seed(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for root, seed in ((a, 3), (b, 3), (c, 4)):
        write_synthetic(root, seed=seed, n_trajectories_small=20, n_trajectories_medium=30, questions_per_type=2)
    files = ["questions.jsonl", "trajectories.jsonl", "haystacks/lme_v2_small.json", "haystacks/lme_v2_medium.json",
             EVIDENCE_FILE]
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    shots = sorted(p.relative_to(a) for p in (a / "screenshots").rglob("*.png"))
    assert shots and all((a / p).read_bytes() == (b / p).read_bytes() for p in shots[:20])
    assert (a / "trajectories.jsonl").read_bytes() != (c / "trajectories.jsonl").read_bytes()
    assert len(load_lme(a).questions) == 14
    summary = synth_command(str(a), 3, 20, 30, 2)  # rewriting an earlier synthetic set is allowed
    assert "14 questions" in summary and "30 trajectories" in summary and "\n" not in summary


def test_one_domain_shares_one_haystack(tmp_path):
    write_synthetic(tmp_path, seed=0, n_trajectories_small=8, n_trajectories_medium=12, questions_per_type=1,
                    domains=("web",))
    data = load_lme(tmp_path)
    assert {q.domain for q in data.questions} == {"web"} and len(data.questions) == 7
    shared = data.shared_haystack("small")
    assert shared is not None and len(shared) == 8 and len(data.shared_haystack("medium")) == 12


def test_synth_refuses_bad_sizes_and_foreign_dirs(tmp_path):
    with pytest.raises(MemexError, match="too few"):
        write_synthetic(tmp_path / "x", n_trajectories_small=5)
    with pytest.raises(MemexError, match="at least the small"):
        write_synthetic(tmp_path / "y", n_trajectories_small=24, n_trajectories_medium=10)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "notes.txt").write_text("mine")
    with pytest.raises(MemexError, match="not empty"):
        write_synthetic(tmp_path / "z")
    with pytest.raises(MemexError, match="domains"):
        write_synthetic(tmp_path / "w", domains=("mobile",))


def _edit_jsonl(path: Path, line: int, edit) -> None:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    edit(rows[line - 1])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _edit_haystack(root: Path, edit) -> None:
    path = root / "haystacks/lme_v2_small.json"
    hay = json.loads(path.read_text())
    edit(hay)
    path.write_text(json.dumps(hay, indent=1))


BAD = {
    "question missing field": (lambda r: _edit_jsonl(r / "questions.jsonl", 3, lambda q: q.pop("answer")),
                               ["questions.jsonl line 3", "'answer'"]),
    "unknown eval function": (lambda r: _edit_jsonl(r / "questions.jsonl", 2, lambda q: q.update(
        eval_function="fuzzy_match|x=1")), ["questions.jsonl line 2", "synth-static-01", "fuzzy_match"]),
    "unknown question type": (lambda r: _edit_jsonl(r / "questions.jsonl", 4, lambda q: q.update(
        question_type="static")), ["questions.jsonl line 4", "question_type"]),
    "image missing": (lambda r: _edit_jsonl(r / "questions.jsonl", 5, lambda q: q.update(
        image="question_screenshots/gone.png")), ["questions.jsonl line 5", "gone.png", "does not exist"]),
    "duplicate question id": (lambda r: _edit_jsonl(r / "questions.jsonl", 6, lambda q: q.update(
        id="synth-static-00")), ["questions.jsonl line 6", "duplicate", "line 1"]),
    "wrong field type": (lambda r: _edit_jsonl(r / "questions.jsonl", 7, lambda q: q.update(answer=5)),
                         ["questions.jsonl line 7", "'answer'", "must be a string"]),
    "trajectory missing field": (lambda r: _edit_jsonl(r / "trajectories.jsonl", 2, lambda t: t.pop("start_url")),
                                 ["trajectories.jsonl line 2", "'start_url'"]),
    "state without url": (lambda r: _edit_jsonl(r / "trajectories.jsonl", 7, lambda t: t["states"][1].pop("url")),
                          ["trajectories.jsonl line 7", "state 1", "'url'"]),
    "empty states": (lambda r: _edit_jsonl(r / "trajectories.jsonl", 1, lambda t: t.update(states=[])),
                     ["trajectories.jsonl line 1", "non-empty"]),
    "haystack unknown trajectory": (lambda r: _edit_haystack(r, lambda h: h["synth-static-02"].append("nope")),
                                    ["lme_v2_small.json line", "synth-static-02", "'nope'", "not in trajectories"]),
    "haystack unknown question": (lambda r: _edit_haystack(r, lambda h: h.update(ghost=[])),
                                  ["lme_v2_small.json line", "ghost", "not in questions.jsonl"]),
    "missing file": (lambda r: (r / "trajectories.jsonl").unlink(), ["trajectories.jsonl", "memexrl lme synth"]),
    "missing root": (lambda r: shutil.rmtree(r), ["not found", "questions.jsonl", "memexrl lme synth --out"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_clear_line(synth, tmp_path, case):
    root = tmp_path / "data"
    shutil.copytree(synth[0], root, ignore=shutil.ignore_patterns("screenshots"))
    mutate, expected = BAD[case]
    mutate(root)
    with pytest.raises(MemexError) as err:
        load_lme(root)
    message = str(err.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, (part, message)


def test_haystack_line_numbers_and_custom_files(synth, tmp_path):
    root, _, data, _ = synth
    path = tmp_path / "mine.json"
    qid = data.questions[-1].id
    path.write_text(json.dumps({qid: data.haystack("small")[qid][:3]}, indent=1))
    assert [q.id for q in data.questions_in(str(path))] == [qid]
    assert data.shared_haystack(str(path)) == data.haystack("small")[qid][:3]
    path.write_text(json.dumps({qid: ["nope"]}, indent=1))
    data._haystacks.clear()
    with pytest.raises(MemexError, match=r"mine.json line 3 .*'nope' is not in trajectories.jsonl"):
        data.haystack(str(path))
    with pytest.raises(MemexError, match="haystack file not found"):
        data.haystack(str(tmp_path / "absent.json"))
