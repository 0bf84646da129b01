"""The output contract of `memexrl eval lme`: `per_question.jsonl` rows and `aggregated_metrics.json`.

lme-v2.md "Outputs". Field names are those of the benchmark's public harness
(evaluation/harness.py, `main` and `aggregate_metrics`), so that its tools read our results.

`per_question.jsonl`, one row per question (PER_QUESTION_FIELDS):
  index, question_id, question_type, category (CATEGORY_MAP of question_type),
  is_abstention_problem (eval function is llm_abstention_checker), eval_function, question_text,
  question_image, haystack (ours: the tier, e.g. "small"), haystack_ids, memory_context (the items
  given to the reader, after truncation), memory_query_duration_seconds (wall time of query()
  alone), memory_context_original_token_count, memory_context_token_count (after truncation),
  memory_context_was_truncated, answer_gold, response_raw, response_parsed_boxed, is_unknown,
  score (1.0/0.0), score_bool, usage ({prompt_tokens, completion_tokens, total_tokens}), timestamp_utc.
  Left out from the public harness: stream_index, memory_post_query_* (our memory API has no
  post-query hook) and prompt_messages.

`aggregated_metrics.json` (`aggregate(rows)`); accuracies are fractions in [0, 1]:
  overall: overall_full_set (the accuracy), overall_non_abstention_only, overall_abstention_only,
    count_all_questions, count_non_abstention, count_abstention;
  non_abstention_by_category (static, dynamic, procedure, gotchas), abstention_by_category
    (static-abs, dynamic-abs, procedure-abs), combined_abstention_by_category (static, dynamic,
    procedure: each with its -abs twin), abstention_overall: each {count, pct_correct,
    pct_answered_wrong, pct_unknown} (None when count is 0; correct = score and not unknown);
  tokens: prompt_tokens, completion_tokens, total_tokens, avg_prompt_tokens, avg_completion_tokens,
    avg_total_tokens;
  memory_context: avg_original_tokens, avg_final_tokens, num_truncated_sequences;
  memory_query: avg_seconds, p50_seconds, p95_seconds, max_seconds, total_seconds;
  completed_at_utc; shared_haystack (+ shared_haystack_ids) when rows carry haystack_ids;
  haystack (ours) when every row carries the same one.
Percentiles use the public harness's nearest-rank rule on the sorted durations d (n of them):
p50 = d[n // 2], p95 = d[min(n - 1, int(0.95 * n))], so that latencies compare with theirs.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from common.errors import MemexError

PER_QUESTION_FIELDS = (
    "index", "question_id", "question_type", "category", "is_abstention_problem", "eval_function",
    "question_text", "question_image", "haystack", "haystack_ids", "memory_context",
    "memory_query_duration_seconds", "memory_context_original_token_count", "memory_context_token_count",
    "memory_context_was_truncated", "answer_gold", "response_raw", "response_parsed_boxed", "is_unknown",
    "score", "score_bool", "usage", "timestamp_utc",
)
CATEGORY_MAP = {
    "static-environment": "static", "static-environment-abs": "static-abs",
    "dynamic-environment": "dynamic", "dynamic-environment-abs": "dynamic-abs",
    "procedure": "procedure", "procedure-abs": "procedure-abs", "errors-gotchas": "gotchas",
}
NON_ABSTENTION_CATEGORIES = ("static", "dynamic", "procedure", "gotchas")
ABSTENTION_CATEGORIES = ("static-abs", "dynamic-abs", "procedure-abs")
AGGREGATED_FILE = "aggregated_metrics.json"
PER_QUESTION_FILE = "per_question.jsonl"


def category_of(question_type: str) -> str:
    """The public harness's category of a question type (lme-v2.md "Data layout" lists the seven types)."""
    if question_type not in CATEGORY_MAP:
        raise MemexError(f"unknown question_type {question_type!r}; expected one of {', '.join(CATEGORY_MAP)}")
    return CATEGORY_MAP[question_type]


def _breakdown(rows: list[dict]) -> dict:
    n = len(rows)
    if n == 0:
        return {"count": 0, "pct_correct": None, "pct_answered_wrong": None, "pct_unknown": None}
    unknown = sum(bool(r["is_unknown"]) for r in rows)
    correct = sum(bool(r["score_bool"]) and not r["is_unknown"] for r in rows)
    return {"count": n, "pct_correct": correct / n, "pct_answered_wrong": (n - correct - unknown) / n,
            "pct_unknown": unknown / n}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _row(row: dict) -> dict:
    """A row with the fields aggregate() reads, derived where a hand-made row leaves them out."""
    out = dict(row)
    out.setdefault("category", category_of(row["question_type"]))
    out.setdefault("is_abstention_problem", str(row.get("eval_function", "")).split("|")[0].strip()
                   == "llm_abstention_checker")
    out.setdefault("score_bool", bool(row["score"]))
    out.setdefault("is_unknown", False)
    return out


def aggregate(rows: list[dict]) -> dict:
    """per_question rows -> aggregated_metrics (field names in the module docstring)."""
    if not rows:
        raise MemexError("no per-question rows to aggregate; did any question run?")
    rows = [_row(r) for r in rows]
    non_abst = [r for r in rows if not r["is_abstention_problem"]]
    abst = [r for r in rows if r["is_abstention_problem"]]
    n = len(rows)
    out: dict = {"overall": {
        "overall_full_set": _mean([float(r["score"]) for r in rows]),
        "overall_non_abstention_only": _mean([float(r["score"]) for r in non_abst]),
        "overall_abstention_only": _mean([float(r["score"]) for r in abst]),
        "count_all_questions": n, "count_non_abstention": len(non_abst), "count_abstention": len(abst)}}
    out["non_abstention_by_category"] = {c: _breakdown([r for r in non_abst if r["category"] == c])
                                         for c in NON_ABSTENTION_CATEGORIES}
    out["abstention_by_category"] = {c: _breakdown([r for r in abst if r["category"] == c])
                                     for c in ABSTENTION_CATEGORIES}
    out["combined_abstention_by_category"] = {c: _breakdown([r for r in rows if r["category"] in (c, c + "-abs")])
                                              for c in ("static", "dynamic", "procedure")}
    out["abstention_overall"] = _breakdown(abst)

    usage = [r.get("usage") or {} for r in rows]
    prompt, completion = (sum(int(u.get(k, 0) or 0) for u in usage) for k in ("prompt_tokens", "completion_tokens"))
    out["tokens"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                     "avg_prompt_tokens": prompt / n, "avg_completion_tokens": completion / n,
                     "avg_total_tokens": (prompt + completion) / n}
    out["memory_context"] = {
        "avg_original_tokens": _mean([float(r.get("memory_context_original_token_count", 0)) for r in rows]),
        "avg_final_tokens": _mean([float(r.get("memory_context_token_count", 0)) for r in rows]),
        "num_truncated_sequences": sum(bool(r.get("memory_context_was_truncated")) for r in rows)}
    d = sorted(float(r.get("memory_query_duration_seconds", 0.0)) for r in rows)
    out["memory_query"] = {"avg_seconds": sum(d) / n, "p50_seconds": d[n // 2],
                           "p95_seconds": d[min(n - 1, int(0.95 * n))], "max_seconds": d[-1],
                           "total_seconds": sum(d)}
    out["completed_at_utc"] = datetime.now(timezone.utc).isoformat()
    if all("haystack_ids" in r for r in rows):
        out["shared_haystack"] = all(r["haystack_ids"] == rows[0]["haystack_ids"] for r in rows)
        if out["shared_haystack"]:
            out["shared_haystack_ids"] = list(rows[0]["haystack_ids"])
    tiers = {r.get("haystack") for r in rows}
    if len(tiers) == 1 and None not in tiers:
        out["haystack"] = tiers.pop()
    return out


def read_aggregated(result_dir: str | Path) -> dict:
    """RESULT_DIR/aggregated_metrics.json as a dict; MemexError naming the path when missing or broken."""
    path = Path(result_dir) / AGGREGATED_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MemexError(f"{path} does not exist; is {result_dir} the output folder of `memexrl eval lme`?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MemexError(f"{path} cannot be read as JSON ({exc}); rerun `memexrl eval lme` for it") from None
    if not isinstance(data, dict):
        raise MemexError(f"{path} is not a JSON object; rerun `memexrl eval lme` for it")
    return data


def point_from_result(result_dir: str | Path) -> tuple[float, float]:
    """(accuracy in percent, mean memory query latency in seconds) of a result folder, for LAFS."""
    data = read_aggregated(result_dir)
    try:
        acc = float(data["overall"]["overall_full_set"]) * 100.0
        latency = float(data["memory_query"]["avg_seconds"])
    except (KeyError, TypeError, ValueError):
        raise MemexError(f"{Path(result_dir) / AGGREGATED_FILE} lacks overall.overall_full_set or "
                         "memory_query.avg_seconds; rerun `memexrl eval lme` for it") from None
    return acc, latency
