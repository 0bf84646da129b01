"""Loading an LME-V2 dataset root in the real layout (../shared/reference/lme-v2.md, "Data layout").

`load_lme(root)` reads `questions.jsonl` and `trajectories.jsonl`, checks every record, and the
haystack files present (`haystacks/lme_v2_small.json`, `haystacks/lme_v2_medium.json`); each
problem stops with ONE `MemexError` line naming the file and line (or the question id) and what
to fix. Screenshots are not opened here: a state's `screenshot` is resolved when it is used
(envs/lme_records.py). Unknown files beside the data (e.g. `synth_evidence.json`) are ignored.

As in the benchmark's own validator, a question's haystack holds trajectories of the question's
domain only, so the real data has one shared list per domain, not one for all questions:
`haystack_groups` gives the distinct lists with their questions (one memory each).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import MemexError
from common.jsonl import read_jsonl

QUESTION_TYPES = ("static-environment", "static-environment-abs", "dynamic-environment",
                  "dynamic-environment-abs", "procedure", "procedure-abs", "errors-gotchas")
DOMAINS = ("web", "enterprise")
TIERS = {"small": "haystacks/lme_v2_small.json", "medium": "haystacks/lme_v2_medium.json"}
LAYOUT = ("an LME-V2 data root holds questions.jsonl, trajectories.jsonl, haystacks/lme_v2_small.json, "
          "haystacks/lme_v2_medium.json, question_screenshots/ and screenshots/<trajectory id>/<step>.png "
          "(the Hugging Face dataset xiaowu0162/longmemeval-v2); `memexrl lme synth --out DIR` makes a small one")
QUESTION_FIELDS = ("id", "domain", "question", "answer", "eval_function", "question_type")
TRAJECTORY_FIELDS = ("id", "domain", "goal", "states", "start_url")


@dataclass(frozen=True)
class LMEQuestion:
    """One line of questions.jsonl; `image` is an absolute path (or None), `raw` the record itself."""

    id: str
    domain: str
    question: str
    image: str | None
    answer: str
    eval_function: str
    question_type: str
    raw: dict = field(default_factory=dict, repr=False, compare=False, hash=False)


def _fail(where: str, what: str) -> MemexError:
    return MemexError(f"{where}: {what}")


def _need_str(rec: dict, key: str, where: str, *, empty_ok: bool = False) -> str:
    value = rec[key]
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        kind = "a string" if empty_ok else "a non-empty string"
        raise _fail(where, f"field {key!r} must be {kind}, got {json.dumps(value)[:60]}")
    return value


def _check_fields(rec, fields: tuple[str, ...], where: str, what: str) -> None:
    if not isinstance(rec, dict):
        raise _fail(where, f"a {what} must be a JSON object, got {type(rec).__name__}")
    for key in fields:
        if key not in rec:
            raise _fail(where, f"{what} is missing required field {key!r}; each {what} needs "
                        f"{', '.join(fields)} (lme-v2.md 'Data layout')")


def _check_domain(rec: dict, where: str) -> str:
    domain = rec["domain"]
    if domain not in DOMAINS:
        raise _fail(where, f"domain {json.dumps(domain)[:40]} is not one of {', '.join(DOMAINS)}")
    return domain


def check_question(rec, where: str, root: Path, parsed_specs: dict) -> LMEQuestion:
    """An `LMEQuestion` from one questions.jsonl record, or a MemexError naming `where`."""
    from eval.lme.scoring import parse_eval_function

    _check_fields(rec, QUESTION_FIELDS, where, "question")
    qid = _need_str(rec, "id", where)
    where = f"{where} (question {qid})"
    domain = _check_domain(rec, where)
    text = _need_str(rec, "question", where)
    answer = _need_str(rec, "answer", where, empty_ok=True)
    spec = _need_str(rec, "eval_function", where)
    qtype = rec["question_type"]
    if qtype not in QUESTION_TYPES:
        raise _fail(where, f"unknown question_type {json.dumps(qtype)[:60]}; use one of {', '.join(QUESTION_TYPES)}")
    if spec not in parsed_specs:
        try:
            parsed_specs[spec] = parse_eval_function(spec)
        except MemexError as exc:
            raise _fail(where, str(exc)) from None
    image = rec.get("image")
    if image is not None:
        if not isinstance(image, str) or not image.strip():
            raise _fail(where, "field 'image' must be null or a path relative to the data root")
        path = Path(image) if Path(image).is_absolute() else root / image
        if not path.is_file():
            raise _fail(where, f"image {image!r} does not exist (looked for {path}); put the file there "
                        "(question_screenshots/<id>.png) or set image to null")
        image = str(path.resolve())
    return LMEQuestion(qid, domain, text, image, answer, spec, qtype, rec)


def _check_state(state, where: str) -> None:
    if not isinstance(state, dict):
        raise _fail(where, f"a state must be a JSON object, got {type(state).__name__}")
    if not isinstance(state.get("url"), str) or not state["url"].strip():
        raise _fail(where, "state is missing required field 'url' (a non-empty string)")
    trees = [state[k] for k in ("accessibility_tree", "text") if k in state]
    if not trees:
        raise _fail(where, "state needs its AXTree text in 'accessibility_tree' or 'text'")
    if not all(isinstance(t, str) for t in trees):
        raise _fail(where, "'accessibility_tree'/'text' must be a string")
    if state.get("action") is not None and not isinstance(state["action"], str):
        raise _fail(where, "'action' must be a string (BrowserGym style, e.g. click('a12')) or null")
    for key in ("thought", "thoughts"):
        value = state.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise _fail(where, f"{key!r} must be a string, a list of strings or null")
    if state.get("screenshot") is not None and not isinstance(state["screenshot"], str):
        raise _fail(where, "'screenshot' must be a path relative to the data root (screenshots/<id>/<step>.png)")
    for key in ("step", "state_index"):
        value = state.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _fail(where, f"{key!r} must be an integer >= 0")


def check_trajectory(rec, where: str) -> dict:
    """The trajectory record itself once its fields and states pass, or a MemexError naming `where`."""
    _check_fields(rec, TRAJECTORY_FIELDS, where, "trajectory")
    tid = _need_str(rec, "id", where)
    where = f"{where} (trajectory {tid})"
    _check_domain(rec, where)
    goal = rec["goal"]
    if not isinstance(goal, str) and not (isinstance(goal, list) and all(isinstance(g, str) for g in goal)):
        raise _fail(where, "field 'goal' must be a string (or a list of strings)")
    _need_str(rec, "start_url", where)
    if rec.get("outcome") is not None and not isinstance(rec["outcome"], str):
        raise _fail(where, "field 'outcome' must be a string or null")
    states = rec["states"]
    if not isinstance(states, list) or not states:
        raise _fail(where, "field 'states' must be a non-empty list of states")
    for k, state in enumerate(states):
        _check_state(state, f"{where} state {k}")
    return rec


def _line_of(text: str, needle: str, start: int = 0) -> tuple[int, int]:
    """(line number, offset) of the first `needle` in `text` at or after `start` ((0, start) if absent)."""
    at = text.find(needle, start)
    return (text.count("\n", 0, at) + 1, at) if at >= 0 else (0, start)


def read_haystack(path: Path, questions: dict[str, LMEQuestion], trajectories: dict[str, dict]) -> dict[str, list[str]]:
    """question id -> ordered trajectory ids from a haystack JSON file, every id checked."""
    if not path.is_file():
        raise MemexError(f"haystack file not found: {path}; {LAYOUT}")
    text = path.read_text()
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MemexError(f"{path} line {exc.lineno}: not valid JSON ({exc.msg}); a haystack file is one "
                         "object: question id -> ordered list of trajectory ids") from None
    if not isinstance(payload, dict):
        raise MemexError(f"{path}: a haystack file must be a JSON object: question id -> list of trajectory ids")
    out: dict[str, list[str]] = {}
    for qid, tids in payload.items():
        line, at = _line_of(text, json.dumps(qid))
        where = f"{path} line {line} (question {qid})"
        if qid not in questions:
            raise _fail(where, "question id is not in questions.jsonl; remove the entry or add the question")
        if not isinstance(tids, list) or not all(isinstance(t, str) and t for t in tids):
            raise _fail(where, "the entry must be a list of trajectory ids (strings)")
        seen: set[str] = set()
        for tid in tids:
            bad = ("is not in trajectories.jsonl" if tid not in trajectories else
                   "is listed twice" if tid in seen else
                   f"is a {trajectories[tid]['domain']} trajectory in a {questions[qid].domain} question's haystack"
                   if trajectories[tid]["domain"] != questions[qid].domain else "")
            if bad:
                line = _line_of(text, json.dumps(tid), at)[0] or line
                raise _fail(f"{path} line {line} (question {qid})", f"trajectory id {tid!r} {bad}; fix the "
                            "haystack or the data")
            seen.add(tid)
        out[qid] = list(tids)
    return out


class LMEData:
    """A loaded, validated dataset root: questions (file order), trajectories (id -> record), haystacks."""

    def __init__(self, root: Path, questions: list[LMEQuestion], trajectories: dict[str, dict]):
        self.root = root
        self.questions = questions
        self.trajectories = trajectories
        self.by_id = {q.id: q for q in questions}
        self._haystacks: dict[str, dict[str, list[str]]] = {}

    def question(self, qid: str) -> LMEQuestion:
        if qid not in self.by_id:
            raise MemexError(f"unknown question id {qid!r} in {self.root / 'questions.jsonl'}")
        return self.by_id[qid]

    def haystack_path(self, name: str) -> Path:
        """`small`/`medium` -> the tier file under the root; else a path (as given, or under the root)."""
        if name in TIERS:
            return self.root / TIERS[name]
        path = Path(name)
        return path if path.is_file() or path.is_absolute() else self.root / name

    def haystack(self, name: str) -> dict[str, list[str]]:
        """question id -> ordered trajectory ids of haystack `name` (`small`, `medium` or a JSON file)."""
        path = self.haystack_path(str(name))
        key = str(path.resolve())
        if key not in self._haystacks:
            self._haystacks[key] = read_haystack(path, self.by_id, self.trajectories)
        return self._haystacks[key]

    def _resolve(self, haystack: dict[str, list[str]] | str) -> dict[str, list[str]]:
        return self.haystack(haystack) if isinstance(haystack, (str, Path)) else haystack

    def questions_in(self, haystack: dict[str, list[str]] | str, domain: str | None = None) -> list[LMEQuestion]:
        """The questions (file order) that the haystack has an entry for, optionally of one domain."""
        hay = self._resolve(haystack)
        return [q for q in self.questions if q.id in hay and domain in (None, q.domain)]

    def shared_haystack(self, haystack: dict[str, list[str]] | str, domain: str | None = None) -> list[str] | None:
        """The one ordered list when every question of the haystack (of `domain`, if given) has the same
        list (lme-v2.md "Memory API": then one memory serves them all); None otherwise."""
        hay = self._resolve(haystack)
        lists = {tuple(hay[q.id]) for q in self.questions_in(hay, domain)}
        return list(lists.pop()) if len(lists) == 1 else None

    def haystack_groups(self, haystack: dict[str, list[str]] | str) -> list[tuple[list[str], list[LMEQuestion]]]:
        """[(ordered trajectory ids, the questions that share exactly that list)], in question order:
        one memory per group (one per domain in the real data, one per question at worst)."""
        hay = self._resolve(haystack)
        groups: dict[tuple[str, ...], list[LMEQuestion]] = {}
        for q in self.questions_in(hay):
            groups.setdefault(tuple(hay[q.id]), []).append(q)
        return [(list(ids), qs) for ids, qs in groups.items()]

    def domains(self) -> list[str]:
        return [d for d in DOMAINS if any(q.domain == d for q in self.questions)]


def load_lme(root: str | Path) -> LMEData:
    """Load and validate the dataset root (and the tier haystacks present); MemexError on any problem."""
    root = Path(root)
    if not root.is_dir():
        raise MemexError(f"LME-V2 data root not found: {root}; {LAYOUT}")
    root = root.resolve()
    qpath, tpath = root / "questions.jsonl", root / "trajectories.jsonl"
    missing = "missing file; " + LAYOUT
    questions: list[LMEQuestion] = []
    first: dict[str, int] = {}
    specs: dict = {}
    for n, rec in read_jsonl(qpath, missing, "each line is one question object"):
        q = check_question(rec, f"{qpath} line {n}", root, specs)
        if q.id in first:
            raise MemexError(f"{qpath} line {n}: duplicate question id {q.id!r} (first on line {first[q.id]}); "
                             "ids must be unique")
        first[q.id] = n
        questions.append(q)
    trajectories: dict[str, dict] = {}
    first = {}
    for n, rec in read_jsonl(tpath, missing, "each line is one trajectory object"):
        traj = check_trajectory(rec, f"{tpath} line {n}")
        if traj["id"] in first:
            raise MemexError(f"{tpath} line {n}: duplicate trajectory id {traj['id']!r} (first on line "
                             f"{first[traj['id']]}); ids must be unique")
        first[traj["id"]] = n
        trajectories[traj["id"]] = traj
    data = LMEData(root, questions, trajectories)
    for tier, rel in TIERS.items():
        if (root / rel).is_file():
            data.haystack(tier)
    return data
