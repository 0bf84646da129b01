"""LME-V2 scoring (eval/lme/scoring.py) against hand-worked cases from lme-v2.md "Scoring"."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from common.errors import MemexError
from eval.lme.scoring import (
    DEFAULT_SEPARATORS,
    JUDGED,
    STRUCTURED,
    extract_boxed,
    is_unknown,
    judge_messages,
    mc_choice_match,
    mc_choice_set_match,
    norm_phrase_set_match,
    norm_phrase_set_match_ordered,
    normalize,
    parse_eval_function,
    parse_judgement,
    score,
    score_command,
)

PHRASE = "norm_phrase_set_match|lower=true|normalize_hyphen=true|strip_punct=true|separators=,;|require_non_empty=true"


def test_constants():
    assert DEFAULT_SEPARATORS == (",", ";")
    assert STRUCTURED == {"norm_phrase_set_match", "norm_phrase_set_match_ordered", "mc_choice_match",
                          "mc_choice_set_match"}
    assert JUDGED == {"llm_abstention_checker", "llm_gotchas_checker"}


# ----------------------------------------------------------------------------- spec parsing

def test_parse_real_spec():
    name, opts = parse_eval_function(PHRASE)
    assert name == "norm_phrase_set_match"
    assert opts == {"lower": True, "normalize_hyphen": True, "strip_punct": True, "separators": (",", ";"),
                    "require_non_empty": True}
    assert parse_eval_function("mc_choice_match|strip_chars=.") == ("mc_choice_match", {"strip_chars": "."})
    assert parse_eval_function("llm_gotchas_checker") == ("llm_gotchas_checker", {})


@pytest.mark.parametrize("value, seps", [(",;", (",", ";")), ("; ,", (";", ",")), ("", ()),
                                         ('[",", " and "]', (",", " and ")), ("/", ("/",))])
def test_separators_option(value, seps):
    assert parse_eval_function(f"norm_phrase_set_match|separators={value}")[1]["separators"] == seps


@pytest.mark.parametrize("spec, fragments", [
    ("exact_match|lower=true", ["'exact_match'", "unknown scorer"]),
    ("norm_phrase_set_match|lower", ["'lower'", "no '='"]),
    ("norm_phrase_set_match|lower=true|lower=false", ["'lower'", "given twice"]),
    ("norm_phrase_set_match|seperators=,", ["'seperators'", "takes no option"]),
    ("mc_choice_set_match|separators=,", ["'separators'", "takes no option"]),
    ("norm_phrase_set_match|lower=yes", ["lower", "true or false"]),
    ("norm_phrase_set_match|separators=[1]", ["separators", "JSON"]),
    ("", ["empty"]),
])
def test_parse_errors_one_clear_message(spec, fragments):
    with pytest.raises(MemexError) as err:
        parse_eval_function(spec)
    message = str(err.value)
    assert "\n" not in message and repr(spec) in message
    for fragment in fragments:
        assert fragment in message


# ----------------------------------------------------------------------------- text helpers

def test_normalize():
    assert normalize("  Incident-Portal_v2; My, Open   Items! ") == "incident portal v2 my open items"
    assert normalize("Price: $12.50") == "price 1250"


@pytest.mark.parametrize("reply, parsed", [
    ("Thinking... \\boxed{A} then \\boxed{B}", "B"),
    ("so \\boxed{\\frac{1}{2} of {x}} done", "\\frac{1}{2} of {x}"),
    ("  no box here  ", "no box here"),
    ("open \\boxed{never closed", "never closed"),
    ("empty \\boxed{ }", "empty \\boxed{ }"),
])
def test_extract_boxed(reply, parsed):
    assert extract_boxed(reply) == parsed


def test_is_unknown():
    assert is_unknown(" Unknown ") and is_unknown("UNKNOWN")
    assert not is_unknown("unknown user") and not is_unknown("")


# ----------------------------------------------------------------------------- structured scorers

def test_phrase_set_whole_words_and_any_order():
    assert norm_phrase_set_match("Incident Portal and Incident Mobile", "Incident Mobile, Incident Portal") == 1
    assert norm_phrase_set_match("the INCIDENT-portal.", "incident portal") == 1
    # whole-word: "port" is not in "portal"; "cat" is not in "category"
    assert norm_phrase_set_match("incident portal", "port") == 0
    assert norm_phrase_set_match("category page", "cat") == 0
    assert norm_phrase_set_match("Reports only", "Reports;Problems") == 0


def test_phrase_set_separators_option():
    # default separators split on ',' and ';' only: "A/B" is one phrase "ab" after normalising
    assert norm_phrase_set_match("beta then alpha", "alpha/beta") == 0
    assert norm_phrase_set_match("beta then alpha", "alpha/beta", separators=("/",)) == 1
    # no separators: the whole gold is one phrase (its comma becomes a space)
    assert norm_phrase_set_match("red green", "red, green", separators=()) == 1
    assert norm_phrase_set_match("green red", "red, green", separators=()) == 0
    assert score("norm_phrase_set_match|separators=/", "alpha/beta", "beta and alpha") == 1


def test_phrase_set_ordered():
    gold = "Open, Assign, Close"
    assert norm_phrase_set_match_ordered("open the ticket, assign it, then close it", gold) == 1
    assert norm_phrase_set_match_ordered("assign, open, close", gold) == 0
    assert norm_phrase_set_match("assign, open, close", gold) == 1
    # each phrase is searched after the previous match ends: a repeated phrase needs two occurrences
    assert norm_phrase_set_match_ordered("save then save", "save; save") == 1
    assert norm_phrase_set_match_ordered("save then close", "save; save") == 0


@pytest.mark.parametrize("scorer", [norm_phrase_set_match, norm_phrase_set_match_ordered, mc_choice_match,
                                    mc_choice_set_match])
def test_empty_sides_score_zero(scorer):
    assert scorer("", "A") == 0
    assert scorer("A", "") == 0
    assert scorer("", "") == 0


def test_empty_after_cleaning_scores_zero():
    assert norm_phrase_set_match("!!!", "a") == 0           # prediction normalises to ""
    assert norm_phrase_set_match("anything", ", ; ,") == 0  # gold has no phrase
    assert mc_choice_match("Option.", "B") == 0             # nothing left after removing 'option' and '.'
    assert mc_choice_set_match("Final answer", "A") == 0    # only filler words
    # require_non_empty=false is accepted for compatibility, but empty still scores 0 (lme-v2.md)
    assert score("norm_phrase_set_match|require_non_empty=false", ";", "x") == 0


def test_mc_choice_match():
    assert mc_choice_match("Option B.", "B") == 1
    assert mc_choice_match("choice c", " c ") == 1
    assert mc_choice_match("\\boxed{Option D}", "D") == 1
    assert mc_choice_match("B or C", "B") == 0
    assert mc_choice_match("Options B", "B") == 0         # 'options' is not the word 'option'
    assert mc_choice_match("B", "B.") == 0                # the gold is only stripped and upper-cased
    assert mc_choice_match("B,", "B", strip_chars=",") == 1


def test_mc_choice_set_match():
    assert mc_choice_set_match("Final answer: options A and C", "C, A") == 1
    assert mc_choice_set_match("AC", "A;C") == 1
    assert mc_choice_set_match("A, B", "A;C") == 0
    assert mc_choice_set_match("The answer is B", "B") == 0  # THE, IS are letters too
    assert mc_choice_set_match("Letters: B, B", "b") == 1


def test_score_unknown_is_zero_and_structured_never_calls_judge():
    class Exploding:
        def complete(self, messages):
            raise AssertionError("the judge must not be called")

    assert score(PHRASE, "unknown", "UNKNOWN", judge=Exploding()) == 0
    assert score("mc_choice_match", "B", "Option B.", judge=Exploding()) == 1


def test_score_command_takes_last_box():
    assert score_command(PHRASE, "Incident Mobile, Incident Portal",
                         "I think \\boxed{nothing}... final: \\boxed{Incident Portal and Incident Mobile}") == "1"
    assert score_command("mc_choice_match", "B", "\\boxed{Option B.}") == "1"
    assert score_command("mc_choice_match", "B", "\\boxed{UNKNOWN}") == "0"
    assert score_command("mc_choice_match", "B", "no box: B") == "0"


def test_judged_spec_without_judge_asks_for_it():
    with pytest.raises(MemexError, match="--judge"):
        score("llm_gotchas_checker|require_non_empty=true", "gold", "reply")


# ----------------------------------------------------------------------------- judge messages and parsing
# These tests cover only message building and parse_judgement: the `FixedJudge` below returns fixed JSON
# text, so the judge path is exercised end to end without saying anything about a real judge's verdicts.

@pytest.mark.parametrize("kind, key", [("abstention", "premise"), ("llm_abstention_checker", "premise"),
                                       ("gotchas", "insight"), ("llm_gotchas_checker", "insight")])
def test_judge_messages(kind, key):
    msgs = judge_messages(kind, "Which tab?", "There is no such tab", "full reply \\boxed{x}", "x")
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    for part in ("Which tab?", "There is no such tab", "full reply \\boxed{x}", '"label"', '"reason"'):
        assert part in user
    assert key in msgs[0]["content"]


def test_judge_messages_rubrics_differ():
    abst = judge_messages("abstention", "q", "g", "r", "p")[1]["content"]
    gotcha = judge_messages("gotchas", "q", "g", "r", "p")[1]["content"]
    assert "UNKNOWN" in abst and "live environment" in abst and "contradicts itself" in abst
    assert "at least one insight" in gotcha
    with pytest.raises(MemexError, match="judge kind"):
        judge_messages("style", "q", "g", "r", "p")


@pytest.mark.parametrize("text, label", [
    ('{"label": 1, "reason": "names the flaw"}', 1),
    ('```json\n{"label": 0, "reason": "follows the premise"}\n```', 0),
    ('Sure. Here is my grade:\n{"label": "1", "reason": "ok"} Hope it helps.', 1),
    ('<think>maybe {"label": 0}</think>{"label": 1, "reason": "final"}', 1),
    ("label: 1", 1),
])
def test_parse_judgement(text, label):
    assert parse_judgement(text)[0] == label


@pytest.mark.parametrize("text", ["", "I think it is right.", '{"label": 2, "reason": "x"}', "{broken json"])
def test_parse_judgement_unparseable_is_zero(text):
    label, reason = parse_judgement(text)
    assert label == 0 and "unparseable" in reason


def test_parse_judgement_reason():
    assert parse_judgement('```json\n{"label": 1, "reason": "names the flaw"}\n```') == (1, "names the flaw")


class FixedJudge:
    """Returns fixed JSON text and records what it was asked (a parse/messaging test only)."""

    def __init__(self, text):
        self.text, self.asked = text, []

    def complete(self, messages):
        self.asked.append(messages)
        return self.text


def test_score_with_fixed_judge_text():
    judge = FixedJudge('```json\n{"label": 1, "reason": "ok"}\n```')
    assert score("llm_abstention_checker|require_non_empty=true", "No such page exists", "\\boxed{no such page}",
                 question="Where is page X?", reply="It does not exist. \\boxed{no such page}", judge=judge) == 1
    user = judge.asked[0][1]["content"]
    assert "Where is page X?" in user and "It does not exist." in user
    assert score("llm_gotchas_checker", "g", "x", judge=FixedJudge("no idea")) == 0
    assert score("llm_gotchas_checker", "g", "unknown", judge=FixedJudge('{"label": 1}')) == 0
    assert score_command("llm_gotchas_checker", "g", "\\boxed{y}", judge=FixedJudge('{"label": 1}')) == "1"
    empty_gold = FixedJudge('{"label": 1}')
    assert score("llm_gotchas_checker", "  ", "x", judge=empty_gold) == 0 and not empty_gold.asked
