"""`memexrl eval lme`: build a memory from a haystack, query it per question, read, score (lme-v2.md).

For one haystack tier (`small`, `medium` or a JSON file) and one memory module:

1. the memory: the questions that share the same ordered haystack share ONE memory that gets
   every trajectory `insert`ed in order (one per domain in the real data, whose haystacks hold
   only the question's domain; one per question at worst), saved to `OUT/memory_state/<group>/`
   and loaded from there by a rerun: a haystack is inserted once; then `warm_up()` (a model, an engine
   started), so that no question's latency holds a start-up;
2. per question: `query(question, image)` timed alone (`memory_query_duration_seconds`, the
   LAFS latency), the items checked against the API, cut to the reader's budget by whole items,
   the reader's reply, the last `\\boxed{}`, the score (eval/lme/scoring.py; the judge for the
   two LLM-judged eval functions);
3. `OUT/per_question.jsonl` is appended question by question (a rerun skips the questions it
   already holds: an interrupted run resumes), then `OUT/aggregated_metrics.json` (eval/lme/metrics.py).

On a data set from `memexrl lme synth` (its `synth_evidence.json` names the planted answer strings), each
row also gets `evidence_share` (the share of the question's planted strings found, as whole words, in the
context the reader got: the reading env's R_task, rewards/reading.py) and `evidence_in_context` (all of
them), and the aggregates `evidence_recall` (the share of questions with all of them) and
`evidence_string_recall` (the mean share): diagnostics of ours, not the benchmark's, that compare memory
modules when the reader is too weak to answer (SmolLM2 on a CPU).

The reader's budget is 200,000 tokens of its tokenizer (the benchmark's); a local reader's own
window is smaller, so for it the budget is its window minus the system prompt, question and
answer room (documented deviation: a 135M model cannot read 200K tokens).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm

from eval.lme.data import LMEData, LMEQuestion, load_lme
from eval.lme.llm import ChatLLM, LocalChat
from eval.lme.memory.base import Memory, MemoryOptions, load_memory, make_memory
from eval.lme.metrics import AGGREGATED_FILE, PER_QUESTION_FILE, aggregate, category_of
from eval.lme.reader import (
    MAX_CONTEXT_TOKENS,
    ContextCounter,
    reader_messages,
    truncate_items,
    validate_items,
)
from eval.lme.scoring import extract_boxed, is_unknown, parse_eval_function, score
from rewards.reading import evidence_found

log = logging.getLogger(__name__)
MEMORY_STATE = "memory_state"


@dataclass
class LMERun:
    """One `eval lme` invocation."""

    data: Path
    haystack: str
    memory: str
    out: Path
    reader: ChatLLM
    judge: ChatLLM | None = None
    counter: ContextCounter | None = None  # the reader's tokenizer (LocalChat: its own)
    max_context_tokens: int = MAX_CONTEXT_TOKENS
    questions: int = 0  # 0: all questions of the haystack
    options: MemoryOptions = field(default_factory=MemoryOptions)


def reader_budget(run: LMERun) -> int:
    """200K tokens, or for a local reader its window less the prompt's fixed parts and the answer."""
    if isinstance(run.reader, LocalChat):
        return min(run.max_context_tokens, run.reader.max_input_tokens - 600)
    return run.max_context_tokens


def build_memory(run: LMERun, data: LMEData, trajectory_ids: list[str], state_dir: Path | None) -> Memory:
    """A memory holding `trajectory_ids` (in order): loaded from `state_dir` when saved there, else built."""
    if state_dir is not None and (state_dir / "DONE").is_file():
        log.info("loading the %s memory saved in %s", run.memory, state_dir)
        return load_memory(run.memory, state_dir, run.options)
    memory = make_memory(run.memory, run.options)
    try:
        for tid in tqdm(trajectory_ids, desc=f"insert ({run.memory})", unit="traj"):
            memory.insert(data.trajectories[tid])
        memory.flush()  # queued work (embeddings) now, so that query latency is query() alone
        if state_dir is not None:
            memory.save(state_dir)
            (state_dir / "DONE").write_text(json.dumps({"trajectories": len(trajectory_ids)}))
    except BaseException:  # what the memory holds open (a database, a managed vLLM server) closes with the run
        memory.close()
        raise
    return memory


def answer_question(run: LMERun, memory: Memory, q: LMEQuestion, index: int, haystack_ids: list[str]) -> dict:
    """One per_question row (eval/lme/metrics.py PER_QUESTION_FIELDS)."""
    started = time.perf_counter()
    items = memory.query(q.question, q.image)
    query_s = time.perf_counter() - started
    items = validate_items(items, q.id)
    counter = run.counter or ContextCounter(run.reader.tokenizer)  # type: ignore[attr-defined]
    kept, original, final = truncate_items(items, counter, reader_budget(run))
    reply = run.reader.complete(reader_messages(q.domain, kept, q.question, q.image))
    reader_usage = dict(getattr(run.reader, "last_usage", None) or {})  # before the judge (maybe the same LLM)
    parsed = extract_boxed(reply)
    name, _ = parse_eval_function(q.eval_function)
    points = score(q.eval_function, q.answer, parsed, question=q.question, reply=reply, judge=run.judge)
    return {
        "index": index, "question_id": q.id, "question_type": q.question_type,
        "category": category_of(q.question_type), "is_abstention_problem": name == "llm_abstention_checker",
        "eval_function": q.eval_function, "question_text": q.question, "question_image": q.image,
        "haystack": run.haystack, "haystack_ids": haystack_ids, "memory_context": kept,
        "memory_query_duration_seconds": query_s, "memory_context_original_token_count": original,
        "memory_context_token_count": final, "memory_context_was_truncated": final < original,
        "answer_gold": q.answer, "response_raw": reply, "response_parsed_boxed": parsed,
        "is_unknown": is_unknown(parsed), "score": float(points), "score_bool": bool(points),
        "usage": reader_usage, "timestamp_utc": datetime.now(timezone.utc).isoformat(),
    }


def evidence_strings(root: Path) -> dict[str, list[str]]:
    """question id -> the answer strings `lme synth` planted ({} for other data sets)."""
    path = Path(root) / "synth_evidence.json"
    if not path.is_file():
        return {}
    return {qid: [needle[-1] for needle in e.get("needles", [])] for qid, e in json.loads(path.read_text()).items()}


def evidence_share(row: dict, strings: list[str]) -> float | None:
    """The share of the planted strings in the text the reader got, each as a whole word or phrase (the reading
    reward's test, rewards/reading.py; None: nothing planted for this question)."""
    if not strings:
        return None
    text = "\n".join(i["value"] for i in row["memory_context"] if i["type"] == "text")
    found = evidence_found(text, strings)
    return sum(found) / len(found)


def done_rows(path: Path) -> dict[str, dict]:
    """The rows an earlier (interrupted) run wrote, by question id; a torn last line is dropped."""
    rows: dict[str, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line being written when the run was stopped
            rows[row["question_id"]] = row
    return rows


def group_key(n: int, questions: list[LMEQuestion]) -> str:
    """The folder of one haystack group's memory: its number and domain (one group per domain in the real data)."""
    return f"group{n:03d}-{questions[0].domain}"


def run_lme_eval(run: LMERun) -> dict:
    """Evaluate `run.memory` on `run.haystack`; write per_question.jsonl and aggregated_metrics.json."""
    data = load_lme(run.data)
    haystacks = data.haystack(run.haystack)
    questions = data.questions_in(haystacks)
    if run.questions:
        questions = questions[: run.questions]
    chosen = {q.id for q in questions}
    run.out.mkdir(parents=True, exist_ok=True)
    per_question = run.out / PER_QUESTION_FILE
    rows = done_rows(per_question)
    # Rewrite the file with the complete rows only (drops a torn line), then append.
    per_question.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    index = {q.id: n for n, q in enumerate(questions)}
    planted = evidence_strings(data.root)
    with per_question.open("a") as f:
        for n, (ids, group) in enumerate(data.haystack_groups(haystacks)):
            todo = [q for q in group if q.id in chosen and q.id not in rows]
            if not todo:
                continue
            key = group_key(n, group)
            options = replace(run.options, extra={**run.options.extra, "workdir": str(run.out / "work" / key)})
            memory = build_memory(replace(run, options=options), data, ids, run.out / MEMORY_STATE / key)
            try:
                memory.warm_up()  # a loaded memory's model starts here, not in its first timed query
                for q in tqdm(todo, desc=f"questions ({run.memory}, {key})", unit="q"):
                    rows[q.id] = answer_question(run, memory, q, index[q.id], ids)
                    share = evidence_share(rows[q.id], planted.get(q.id, []))
                    rows[q.id]["evidence_share"] = share
                    rows[q.id]["evidence_in_context"] = None if share is None else share == 1.0
                    f.write(json.dumps(rows[q.id]) + "\n")
                    f.flush()
            finally:
                memory.close()
    result = aggregate([rows[q.id] for q in questions])
    result["memory"] = run.memory
    checked = [c for c in (rows[q.id].get("evidence_in_context") for q in questions) if c is not None]
    if checked:  # synthetic data only (see the module docstring)
        result["evidence_recall"] = sum(checked) / len(checked)
    shares = [c for c in (rows[q.id].get("evidence_share") for q in questions) if c is not None]
    if shares:  # rows of a run from before evidence_share have none
        result["evidence_string_recall"] = sum(shares) / len(shares)
    (run.out / AGGREGATED_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result
