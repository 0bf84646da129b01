"""LME-V2 LAFS (eval/lme/lafs.py) and the aggregated metrics (eval/lme/metrics.py), worked by hand."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import math

import pytest

from common.errors import MemexError
from eval.lme.lafs import (
    REFERENCE_POINTS,
    accuracy_at,
    format_lafs_report,
    lafs,
    lafs_command,
    lafs_report,
    pareto_frontier,
)
from eval.lme.metrics import PER_QUESTION_FIELDS, aggregate, point_from_result

LN200 = math.log(200)


# ----------------------------------------------------------------------------- LAFS

@pytest.mark.parametrize("tier, value", [("small", 55.76), ("medium", 51.07)])
def test_reference_lafs_to_two_decimals(tier, value):
    assert round(lafs(REFERENCE_POINTS[tier]), 2) == value
    assert f"{lafs_report(tier, [])['reference_lafs']:.2f}" == f"{value:.2f}"


def test_reference_small_by_hand():
    # Codex (69.9 @ 177.2) is dominated by AgentRunbook-C (74.9 @ 108.3); RAG at 0.2 s counts from T = 1
    by_hand = (51.0 * math.log(26.9) + 58.6 * math.log(108.3 / 26.9) + 74.9 * math.log(200 / 108.3)) / LN200
    assert lafs(REFERENCE_POINTS["small"]) == pytest.approx(by_hand, abs=1e-12)
    assert pareto_frontier(REFERENCE_POINTS["small"]) == [(51.0, 0.2), (58.6, 26.9), (74.9, 108.3)]


def test_one_point_by_hand():
    # A = 0 on [1, 10), 50 on [10, 200]
    assert lafs([(50.0, 10.0)]) == pytest.approx(50 * math.log(20) / LN200, abs=1e-12)
    assert lafs([(60.0, 0.5)]) == pytest.approx(60.0)   # faster than 1 s: counts over all of [1, 200]
    assert lafs([(60.0, 0.0)]) == pytest.approx(60.0)
    assert lafs([(90.0, 250.0)]) == 0.0                 # slower than 200 s never counts
    assert lafs([]) == 0.0


def test_accuracy_at_and_frontier():
    pts = [(50.0, 10.0), (40.0, 20.0), (70.0, 30.0), (70.0, 40.0), (65.0, 5.0)]
    assert pareto_frontier(pts) == [(65.0, 5.0), (70.0, 30.0)]
    assert accuracy_at(pts, 4.9) == 0.0
    assert accuracy_at(pts, 5.0) == 65.0
    assert accuracy_at(pts, 30.0) == 70.0


def test_gain_positive_for_dominating_point_zero_for_dominated():
    ref = REFERENCE_POINTS["small"]
    better = lafs_report("small", [(62.0, 15.0)])
    # 62 @ 15 s replaces 51 on [15, 108.3) and makes AgentRunbook-R (58.6 @ 26.9) dominated
    by_hand = (51.0 * math.log(15) + 62.0 * math.log(108.3 / 15) + 74.9 * math.log(200 / 108.3)) / LN200
    assert better["lafs"] == pytest.approx(by_hand, abs=1e-12)
    assert better["gain"] == pytest.approx(by_hand - lafs(ref), abs=1e-12) and better["gain"] > 0
    dominated = lafs_report("small", [(70.0, 150.0)])
    assert dominated["gain"] == 0.0 and dominated["lafs"] == dominated["reference_lafs"]


def test_negative_latency_is_an_error():
    with pytest.raises(MemexError, match="latency"):
        lafs([(50.0, -1.0)])


def test_format_report_two_decimals():
    text = format_lafs_report(lafs_report("medium", [(62.0, 15.0)]))
    assert "reference LAFS   51.07" in text and "62.00" in text and "15.00" in text and "yes" in text


# ----------------------------------------------------------------------------- aggregate

def rows():
    def row(qid, qtype, score, seconds, *, spec="norm_phrase_set_match", unknown=False, truncated=False):
        return {"question_id": qid, "question_type": qtype, "eval_function": spec, "score": float(score),
                "score_bool": bool(score), "is_unknown": unknown, "memory_query_duration_seconds": seconds,
                "memory_context_original_token_count": 300 if truncated else 100,
                "memory_context_token_count": 200 if truncated else 100,
                "memory_context_was_truncated": truncated, "haystack": "small", "haystack_ids": ["t1", "t2"],
                "usage": {"prompt_tokens": 1000, "completion_tokens": 10, "total_tokens": 1010}}

    return [row("q1", "static-environment", 1, 1.0),
            row("q2", "static-environment-abs", 0, 3.0, spec="llm_abstention_checker", unknown=True),
            row("q3", "errors-gotchas", 1, 2.0, spec="llm_gotchas_checker"),
            row("q4", "procedure", 0, 10.0, truncated=True)]


def test_aggregate_hand_made_rows():
    agg = aggregate(rows())
    assert agg["overall"] == {"overall_full_set": 0.5, "overall_non_abstention_only": pytest.approx(2 / 3),
                              "overall_abstention_only": 0.0, "count_all_questions": 4,
                              "count_non_abstention": 3, "count_abstention": 1}
    assert agg["non_abstention_by_category"]["static"] == {"count": 1, "pct_correct": 1.0,
                                                           "pct_answered_wrong": 0.0, "pct_unknown": 0.0}
    assert agg["non_abstention_by_category"]["procedure"]["pct_answered_wrong"] == 1.0
    assert agg["non_abstention_by_category"]["dynamic"]["pct_correct"] is None
    assert agg["abstention_by_category"]["static-abs"]["pct_unknown"] == 1.0
    assert agg["combined_abstention_by_category"]["static"]["count"] == 2
    assert agg["combined_abstention_by_category"]["static"]["pct_correct"] == 0.5
    # durations sorted [1, 2, 3, 10]: nearest rank p50 = d[4 // 2] = 3, p95 = d[min(3, int(3.8))] = 10
    assert agg["memory_query"] == {"avg_seconds": 4.0, "p50_seconds": 3.0, "p95_seconds": 10.0,
                                   "max_seconds": 10.0, "total_seconds": 16.0}
    assert agg["memory_context"] == {"avg_original_tokens": 150.0, "avg_final_tokens": 125.0,
                                     "num_truncated_sequences": 1}
    assert agg["tokens"]["total_tokens"] == 4040 and agg["tokens"]["avg_prompt_tokens"] == 1000.0
    assert agg["haystack"] == "small" and agg["shared_haystack"] is True


def test_aggregate_errors():
    with pytest.raises(MemexError, match="no per-question rows"):
        aggregate([])
    with pytest.raises(MemexError, match="question_type"):
        aggregate([{"question_type": "trivia", "score": 1.0}])


def test_per_question_fields_cover_the_outputs():
    for field in ("question_id", "question_type", "memory_context", "memory_context_token_count",
                  "memory_context_was_truncated", "memory_query_duration_seconds", "answer_gold", "response_raw",
                  "response_parsed_boxed", "score"):
        assert field in PER_QUESTION_FIELDS


# ----------------------------------------------------------------------------- result folders and the command

def write_result(path, haystack="small"):
    path.mkdir()
    agg = aggregate(rows())
    if haystack is None:
        agg.pop("haystack")
    (path / "aggregated_metrics.json").write_text(json.dumps(agg))
    return str(path)


def test_point_from_result(tmp_path):
    assert point_from_result(write_result(tmp_path / "run")) == (50.0, 4.0)
    with pytest.raises(MemexError, match="aggregated_metrics.json"):
        point_from_result(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "aggregated_metrics.json").write_text("{not json")
    with pytest.raises(MemexError, match="broken"):
        point_from_result(tmp_path / "broken")


def test_lafs_command(tmp_path):
    text = lafs_command("small", ["62,15"], [])
    assert "55.76" in text and "57.87" in text and "+2.11" in text
    # the tier comes from the result's stored haystack; the (50 %, 4 s) point is dominated by RAG (51 %, 0.2 s)
    text = lafs_command(None, [], [write_result(tmp_path / "run")])
    assert "small" in text and "+0.00" in text and "50.00" in text
    with pytest.raises(MemexError, match="--tier"):
        lafs_command(None, [], [write_result(tmp_path / "anon", haystack=None)])
    with pytest.raises(MemexError, match="--tier"):
        lafs_command(None, ["60,1"], [])
    with pytest.raises(MemexError, match="medium"):
        lafs_command("medium", [], [str(tmp_path / "run")])


@pytest.mark.parametrize("bad", ["62", "62;15", "sixty,15", "150,3", "60,-2"])
def test_lafs_command_bad_point(bad):
    with pytest.raises(MemexError) as err:
        lafs_command("small", [bad], [])
    assert repr(bad) in str(err.value)
