"""LME-V2 answer scoring: the `eval_function` specs, the four structured scorers, the LLM judge.

Follows ../shared/reference/lme-v2.md, "Scoring" (and "Reader and prompt" for the parsed answer).
Names match the benchmark's public code (evaluation/qa_eval_metrics.py), so that the real
`questions.jsonl` specs work unchanged:

- A spec is `name|key=value|...`. `true`/`false` become booleans; `separators=` takes its
  value as a set of single characters (`separators=,;`, whitespace ignored, empty = do not
  split) or a JSON list (`separators=[",", ";"]`); every other value stays a string. An unknown
  name, an option without `=`, a repeated option -> `MemexError`.
- Option names are checked per scorer (`OPTIONS`), so that a typo such as `seperators=` is an
  error instead of a silently ignored option. The accepted names are the ones the real scorers
  take: the phrase scorers `separators`, `lower`, `normalize_hyphen`, `strip_punct`; the
  `mc_choice_match` scorer `strip_chars` (default "."); all scorers `require_non_empty`. The
  evaluator settings of the real code (`evaluator_model=`...) are not spec options here: the
  judge is chosen by the user (`--judge`), never by the data set.
- `require_non_empty` is accepted for compatibility and has no effect: lme-v2.md says every
  scorer returns 0 when either side is empty after its own cleaning, always.
- The parsed answer is the content of the LAST `\\boxed{...}` of the reply (nested braces
  handled; an unclosed box runs to the end); with no box, or an empty one, the whole reply
  stripped (as the public harness does). A parsed answer "unknown" (any case) scores 0.
- `llm_abstention_checker` and `llm_gotchas_checker` ask a judge LLM (any object with
  `complete(messages) -> str`) for JSON `{"label": 0|1, "reason": ...}`; the structured
  scorers never call it.
"""

from __future__ import annotations

import json
import re

from common.errors import MemexError

DEFAULT_SEPARATORS = (",", ";")
STRUCTURED = frozenset({"norm_phrase_set_match", "norm_phrase_set_match_ordered", "mc_choice_match",
                        "mc_choice_set_match"})
JUDGED = frozenset({"llm_abstention_checker", "llm_gotchas_checker"})
JUDGE_KIND = {"llm_abstention_checker": "abstention", "llm_gotchas_checker": "gotchas"}

_PHRASE_OPTIONS = frozenset({"separators", "lower", "normalize_hyphen", "strip_punct", "require_non_empty"})
OPTIONS: dict[str, frozenset[str]] = {
    "norm_phrase_set_match": _PHRASE_OPTIONS,
    "norm_phrase_set_match_ordered": _PHRASE_OPTIONS,
    "mc_choice_match": frozenset({"strip_chars", "require_non_empty"}),
    "mc_choice_set_match": frozenset({"require_non_empty"}),
    "llm_abstention_checker": frozenset({"require_non_empty"}),
    "llm_gotchas_checker": frozenset({"require_non_empty"}),
}
_BOOL_OPTIONS = frozenset({"lower", "normalize_hyphen", "strip_punct", "require_non_empty"})
# lme-v2.md: filler words dropped by mc_choice_set_match before splitting runs into letters.
MC_FILLER_WORDS = frozenset({"AND", "ANSWER", "ANSWERS", "CHOICE", "CHOICES", "FINAL", "LETTER", "LETTERS",
                             "OPTION", "OPTIONS"})


# ----------------------------------------------------------------------------- specs

def _separators(spec: str, value: str) -> tuple[str, ...]:
    text = value.strip()
    if text.startswith("["):
        try:
            seps = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MemexError(f"eval_function {spec!r}: separators={value} is not a valid JSON list ({exc.msg})") from None
        if not isinstance(seps, list) or not all(isinstance(s, str) and s for s in seps):
            raise MemexError(f"eval_function {spec!r}: separators= as JSON must be a list of non-empty strings")
        return tuple(seps)
    return tuple(ch for ch in text if not ch.isspace())


def parse_eval_function(spec: str) -> tuple[str, dict]:
    """`name|key=value|...` -> (name, options) (lme-v2.md "Scoring"; rules in the module docstring)."""
    if not isinstance(spec, str) or not spec.strip():
        raise MemexError(f"eval_function {spec!r} is empty; expected 'name|key=value|...'")
    name, *parts = [part.strip() for part in spec.split("|")]
    if name not in OPTIONS:
        raise MemexError(f"eval_function {spec!r}: unknown scorer {name!r}; expected one of {', '.join(sorted(OPTIONS))}")
    options: dict = {}
    for part in parts:
        if not part:
            continue  # a trailing or doubled '|'
        if "=" not in part:
            raise MemexError(f"eval_function {spec!r}: option {part!r} has no '='; write it as key=value")
        key, value = (s.strip() for s in part.split("=", 1))
        if not key:
            raise MemexError(f"eval_function {spec!r}: option {part!r} has no name before '='")
        if key in options:
            raise MemexError(f"eval_function {spec!r}: option {key!r} is given twice")
        if key not in OPTIONS[name]:
            raise MemexError(f"eval_function {spec!r}: {name} takes no option {key!r}; "
                             f"its options are {', '.join(sorted(OPTIONS[name]))}")
        if key == "separators":
            options[key] = _separators(spec, value)
        elif value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        elif key in _BOOL_OPTIONS:
            raise MemexError(f"eval_function {spec!r}: option {key} must be true or false, not {value!r}")
        else:
            options[key] = value
    return name, options


# ----------------------------------------------------------------------------- text helpers

def normalize(text: str, *, lower: bool = True, normalize_hyphen: bool = True, strip_punct: bool = True) -> str:
    """lme-v2.md normalise: lower-case; `-` `_` -> space; `,` `;` -> space; drop `[^\\w\\s]`; collapse spaces."""
    text = "" if text is None else str(text)
    if lower:
        text = text.lower()
    if normalize_hyphen:
        text = text.replace("-", " ").replace("_", " ")
    text = re.sub(r"[,;]", " ", text)
    if strip_punct:
        text = re.sub(r"[^\w\s]", "", text)
    return re.sub(r"\s+", " ", text).strip()


def extract_boxed(reply: str) -> str:
    """The content of the LAST `\\boxed{...}` (nested braces kept); no box or an empty one -> the reply stripped."""
    reply = reply or ""
    start = reply.rfind("\\boxed{")
    if start < 0:
        return reply.strip()
    depth, out = 1, []
    for ch in reply[start + len("\\boxed{"):]:
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            break
        out.append(ch)
    return "".join(out).strip() or reply.strip()


def is_unknown(parsed: str) -> bool:
    """True for the abstaining answer `UNKNOWN` (any case, surrounding spaces ignored): it scores 0."""
    return (parsed or "").strip().lower() == "unknown"


# ----------------------------------------------------------------------------- structured scorers

def _gold_phrases(gold: str, separators, **norm) -> list[str]:
    parts = re.split("|".join(map(re.escape, separators)), gold or "") if separators else [gold or ""]
    return [p for p in (normalize(part, **norm) for part in parts) if p]


def _phrase_match(parsed: str, gold: str, ordered: bool, separators, **norm) -> int:
    pred, phrases = normalize(parsed, **norm), _gold_phrases(gold, separators, **norm)
    if not pred or not phrases:
        return 0
    if not ordered:
        return int(all(re.search(rf"\b{re.escape(p)}\b", pred) for p in set(phrases)))
    pos = 0
    for phrase in phrases:
        match = re.compile(rf"\b{re.escape(phrase)}\b").search(pred, pos)
        if match is None:
            return 0
        pos = match.end()
    return 1


def norm_phrase_set_match(parsed: str, gold: str, *, separators=DEFAULT_SEPARATORS, lower=True,
                          normalize_hyphen=True, strip_punct=True, require_non_empty=True) -> int:
    """1 when every distinct normalised gold phrase occurs in the normalised prediction as a whole word."""
    return _phrase_match(parsed, gold, False, separators, lower=lower, normalize_hyphen=normalize_hyphen,
                         strip_punct=strip_punct)


def norm_phrase_set_match_ordered(parsed: str, gold: str, *, separators=DEFAULT_SEPARATORS, lower=True,
                                  normalize_hyphen=True, strip_punct=True, require_non_empty=True) -> int:
    """As `norm_phrase_set_match`, the phrases in gold order, each searched after the previous match's end."""
    return _phrase_match(parsed, gold, True, separators, lower=lower, normalize_hyphen=normalize_hyphen,
                         strip_punct=strip_punct)


def mc_choice_match(parsed: str, gold: str, *, strip_chars: str = ".", require_non_empty=True) -> int:
    """Prediction (a `\\boxed{}` content in it if any) minus the words choice/option and dots, stripped and
    upper-cased, equal to the gold stripped and upper-cased."""
    parsed, gold = parsed or "", gold or ""
    box = re.search(r"\\boxed\{([^}]*)\}", parsed)
    cleaned = re.sub(r"\b(choice|option)\b", "", box.group(1) if box else parsed, flags=re.IGNORECASE)
    for ch in strip_chars:
        cleaned = cleaned.replace(ch, "")
    cleaned, expected = cleaned.strip().upper(), gold.strip().upper()
    return int(bool(cleaned) and bool(expected) and cleaned == expected)


def mc_letters(text: str) -> set[str]:
    """The letters of the `[A-Z]+` runs of the upper-cased text, filler words (MC_FILLER_WORDS) dropped."""
    runs = re.findall(r"[A-Z]+", (text or "").upper())
    return {letter for run in runs if run not in MC_FILLER_WORDS for letter in run}


def mc_choice_set_match(parsed: str, gold: str, *, require_non_empty=True) -> int:
    """1 when both sides name the same non-empty set of choice letters."""
    pred, expected = mc_letters(parsed), mc_letters(gold)
    return int(bool(pred) and bool(expected) and pred == expected)


SCORERS = {f.__name__: f for f in (norm_phrase_set_match, norm_phrase_set_match_ordered, mc_choice_match,
                                    mc_choice_set_match)}


# ----------------------------------------------------------------------------- LLM judge

_SYSTEM = {
    "abstention": (
        "You grade answers to questions whose premise is false (abstention questions), strictly. The model "
        "passes only if it points out the flawed premise in a way that agrees with the reference answer, or "
        "explicitly says it cannot see the user's live environment/instance and so cannot verify it, without "
        "also answering as if the premise held."),
    "gotchas": (
        "You grade answers to 'gotcha' questions, whose reference answer lists one or more key insights, "
        "strictly. The model passes if it states at least one reference insight (paraphrase is fine) and "
        "nothing it says contradicts any reference insight."),
}
_RUBRIC = {
    "abstention": (
        "- label 1: the response identifies the flawed premise, consistently with the reference answer.\n"
        "- label 1: the response clearly says it has no access to the specific live environment and so cannot "
        "verify, and gives no answer that follows the premise.\n"
        "- label 0: the response accepts the premise and gives a concrete answer under it.\n"
        "- label 0: the response only says UNKNOWN / not enough information, without naming the flaw.\n"
        "- label 0: the response contradicts itself (rejects the premise and also answers under it)."),
    "gotchas": (
        "- label 1: at least one insight of the reference answer is present (paraphrase is fine); covering "
        "only part of a multi-point reference is enough.\n"
        "- label 0: any statement contradicts a reference point, or the direction is wrong (the opposite "
        "action or cause), even when words overlap.\n"
        "- label 0: the response is irrelevant or generic, with no insight."),
}


def _kind(kind: str) -> str:
    kind = JUDGE_KIND.get(kind, kind)
    if kind not in _SYSTEM:
        raise MemexError(f"unknown judge kind {kind!r}; expected abstention, gotchas or one of {sorted(JUDGED)}")
    return kind


def judge_messages(kind: str, question: str, gold: str, reply: str, parsed: str) -> list[dict]:
    """System + user messages for the abstention or gotchas rubric (lme-v2.md "Scoring", LLM judge).

    `kind` is "abstention", "gotchas" or the eval function name. The judge must reply with JSON
    `{"label": 0|1, "reason": "..."}`.
    """
    kind = _kind(kind)
    what = "the flaw in the premise" if kind == "abstention" else "the key insights"
    user = (f"Question:\n{question}\n\nReference answer ({what}):\n{gold}\n\n"
            f"Model's full response:\n{reply}\n\nModel's final answer (the last \\boxed{{}}):\n{parsed}\n\n"
            f"Rubric:\n{_RUBRIC[kind]}\n\n"
            'Reply with JSON only: {"label": 0 or 1, "reason": "one short sentence"}')
    return [{"role": "system", "content": _SYSTEM[kind]}, {"role": "user", "content": user}]


def parse_judgement(text: str) -> tuple[int, str]:
    """The judge's reply -> (label, reason). Tolerates `<think>` blocks, a ```json fence and text around the
    JSON (the last object with a "label" wins); anything unparseable is label 0 with a reason saying so."""
    text = re.sub(r"<think>.*?</think>", "", text or "", flags=re.DOTALL).strip()
    decoder, found = json.JSONDecoder(), None
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "label" in obj:
            found = obj
    if found is not None:
        label = found["label"]
        if label in (0, 1, "0", "1"):  # also true/false and 1.0
            return int(label), str(found.get("reason", "")).strip()
        return 0, f"unparseable judgement: label {label!r} is not 0 or 1"
    loose = re.search(r"""["']?label["']?\s*[:=]\s*["']?([01])\b""", text, flags=re.IGNORECASE)
    if loose:
        return int(loose.group(1)), text
    return 0, f"unparseable judgement (no JSON with a 0/1 label): {text[:200]!r}"


# ----------------------------------------------------------------------------- score

def score(spec: str, gold: str, parsed: str, *, question: str = "", reply: str = "", judge=None) -> int:
    """0/1 for one answer: `parsed` is the last `\\boxed{}` content of the reader's `reply`.

    "unknown" scores 0. Judged specs ask `judge.complete(messages)` (the full reply and the parsed answer
    both go to it) and need `judge`; structured specs never call it.
    """
    name, options = parse_eval_function(spec)
    if name in JUDGED and judge is None:
        raise MemexError(f"eval_function {spec!r} needs an LLM judge; pass --judge (an OpenAI-compatible URL or "
                         "'local')")
    if is_unknown(parsed):
        return 0
    if name in STRUCTURED:
        return SCORERS[name](parsed, gold, **options)
    response = (reply or parsed or "").strip()
    if not response or not (gold or "").strip():
        return 0
    label, _ = parse_judgement(judge.complete(judge_messages(name, question, gold, response, parsed or response)))
    return label


def score_command(spec: str, gold: str, prediction: str, judge=None, *, question: str = "") -> str:
    """`memexrl lme score --eval-function SPEC --answer GOLD --prediction TEXT`: "1" or "0".

    `prediction` is the raw reply; its last `\\boxed{}` content is what the scorers see."""
    return str(score(spec, gold, extract_boxed(prediction), question=question, reply=prediction, judge=judge))
