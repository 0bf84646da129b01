"""Off-plan detours of the Memex expert: recoverable mistakes in demonstrations, not learned themselves.

A policy trained only on a perfect expert never sees the states its own mistakes lead to: after
SFT on clean demonstrations, SmolLM2 loops, its working context grows far past T, and it has
never seen a demonstration compress there (the expert's contexts rarely pass 0.8 T). So, with
probability `expert.detour_rate` at an env action, the expert first makes one of these moves:

- `wander`: go to a receptacle of the room overview it has no plan for;
- `revisit`: go back to a receptacle it already checked (its contents are in the context);
- `repeat`: do the last env action again (a loop; it usually answers "Nothing happens.").

And, with probability `expert.rejected_compress_rate` at a compression, the expert first sends a
CompressExperience the tool rejects (`break_compress`), in the ways a small policy gets it wrong:

- `wrong_anchor`: an end anchor that is not in the context (the last word without its number, ...);
- `missing_anchor`: a block with start and mid anchors but no end anchor;
- `twice`: the same db_index for two blocks;

or one the parser rejects as a format error (`malform_call`), as the policy's own long calls fail:

- `cut`: the call stops before `</tool_call>` (a summary longer than the generation cap);
- `invalid_json`: brackets that do not match (a block's closing brace left out).

The error stays in the context; the next turn (trained) names the mistake and sends the correct
call (after a format error, the shortest one: a long call is what failed). Without these, a policy that sent one wrong call repeated it until its window
was full: it had never seen a rejected compression answered.

The detour turn is played (its observation stays in the context and W grows) but carries loss
mask 0 (`Completion.trained`), so SFT learns what comes after it — compressing past 0.8 T,
reading back names that left the context, returning to the plan — and never the detour itself:
noise injection in the demonstrator, as in DART (Laskey et al., 2017). The handcoded ALFWorld
planner re-plans from any position (`go to` resets its place; failed actions change nothing),
so the episode still ends in success as often as the step limit allows. The paper does not
describe its demonstrations; `expert.detour_rate: 0` gives the clean expert.
"""

from __future__ import annotations

import copy
import random
import re

from memory.anchors import extract_span
from memory.parsing import CLOSE_TAG, OPEN_TAG, parse_tool_call

DETOUR_KINDS = ("wander", "revisit", "repeat")
BROKEN_COMPRESS_KINDS = ("wrong_anchor", "missing_anchor", "twice")  # rejected by CompressExperience
MALFORMED_CALL_KINDS = ("cut", "invalid_json")  # rejected by the parser: format errors
# Verbs safe to repeat: on a second try they change nothing (or only re-open/close), so the planner's
# bookkeeping stays right. `go to` again would make the planner think an opened receptacle is unchecked.
_REPEATABLE = ("examine", "open", "close", "take", "move")


def detour_rng(seed: int, game: str, step: int) -> random.Random:
    """The random stream of one turn of one game: the same demonstrations on every run."""
    return random.Random(f"{seed}:{game}:{step}")


def choose_detour(
    rng: random.Random, receptacles: list[str], checked: list[str], location: str, last_action: str, planned: str
) -> tuple[str, str] | None:
    """(kind, action) of an off-plan env action, or None when no kind applies here.

    `receptacles` come from the room overview, `checked` are the receptacles whose contents were
    seen, `planned` is the action the plan would take now (a detour never equals it).
    """
    options: dict[str, list[str]] = {
        "wander": [f"go to {r}" for r in receptacles if r not in checked and r != location],
        "revisit": [f"go to {r}" for r in checked if r != location],
        "repeat": [last_action] if last_action.split(" ", 1)[0] in _REPEATABLE else [],
    }
    kinds = [k for k in DETOUR_KINDS if any(a != planned for a in options[k])]
    if not kinds:
        return None
    kind = rng.choice(kinds)
    return kind, rng.choice([a for a in options[kind] if a != planned])


def detour_thought(kind: str, action: str) -> str:
    """The thought a drifting agent writes before the detour (in the context, never trained)."""
    place = action.removeprefix("go to ")
    if kind == "wander":
        return f"Maybe something useful is at {place}; let me check it."
    if kind == "revisit":
        return f"Let me check {place} again."
    return f"Let me try that again: {action}."


def _wrong_ends(end: str, span: str) -> list[str]:
    """End anchors a small model writes instead of `end`: without the number ('shelf.'), or another
    name of the span as if it came last ('shelf 6.' where the text says 'shelf 6, ...')."""
    stripped = " ".join(w for w in end.split(" ") if not w.rstrip(".,").isdigit()).strip().rstrip(".")
    return [f"{stripped}.", *(f"{name}." for name in re.findall(r"[a-z]+ \d+(?=,)", span)[::-1])]


def break_compress(rng: random.Random, arguments: dict, context_text: str | list[str]) -> tuple[str, dict] | None:
    """(kind, arguments) of a CompressExperience that the tool rejects, made from the correct
    `arguments` (not changed); None when no kind applies (no block to break)."""
    blocks = arguments.get("db_blocks") or []
    anchored = [i for i, b in enumerate(blocks) if "end_anchor" in b]
    kinds = [k for k in BROKEN_COMPRESS_KINDS if k == "twice" and blocks or k != "twice" and anchored]
    if not kinds:
        return None
    kind, broken = rng.choice(kinds), copy.deepcopy(arguments)
    if kind == "twice":
        broken["db_blocks"].append(copy.deepcopy(rng.choice(blocks)))
        return kind, broken
    block = broken["db_blocks"][rng.choice(anchored)]
    if kind == "missing_anchor":
        del block["end_anchor"]
        return kind, broken
    span = extract_span(context_text, block["start_anchor"], block["mid_anchor"], block["end_anchor"]) or ""
    for end in _wrong_ends(block["end_anchor"], span):
        if end != block["end_anchor"] and extract_span(context_text, block["start_anchor"], block["mid_anchor"], end) is None:
            block["end_anchor"] = end
            return kind, broken
    del block["end_anchor"]  # every wrong end happened to be found: leave it out instead
    return "missing_anchor", broken


def malform_call(rng: random.Random, text: str) -> tuple[str, str] | None:
    """(kind, text) of the assistant turn `text` (thought + one correct call) made malformed so that
    the parser rejects it: cut inside the call's arguments, or with one closing brace left out;
    None when the call has no arguments object to damage."""
    start = text.find(OPEN_TAG)
    body_start = text.find('"arguments"', start)
    if start < 0 or body_start < 0 or not text.endswith(CLOSE_TAG):
        return None
    kind = rng.choice(MALFORMED_CALL_KINDS)
    if kind == "cut":  # somewhere in the second half of the arguments, as a generation cap cuts it
        lo = (body_start + len(text) - len(CLOSE_TAG)) // 2
        return kind, text[: rng.randrange(lo, len(text) - len(CLOSE_TAG) - 1)]
    closing = [body_start + m.start() for m in re.finditer(r"\}", text[body_start:])]
    rng.shuffle(closing)
    for drop in closing:  # a brace inside a string leaves valid JSON: try another
        damaged = text[:drop] + text[drop + 1:]
        if parse_tool_call(damaged).format_error:
            return kind, damaged
    return None


def recovery_thought(error: str) -> str:
    """The (trained) thought after a rejected CompressExperience: what was wrong, then the fix."""
    if error.startswith("Format error: unclosed"):
        return "My call was cut off before </tool_call>: it was too long. I send a shorter compression."
    if error.startswith("Format error"):
        return "My call was not valid JSON. I send a shorter compression and close every bracket."
    if "appears twice" in error:
        return "My compression was rejected: I used one index twice. Each block gets its own index; I retry."
    if "missing" in error:
        return "My compression was rejected: a block lacked an anchor. I give all three anchors and retry."
    if "anchors not found" in error:
        return "My compression was rejected: an anchor was not in my context. I copy the anchors exactly and retry."
    return "My compression was rejected. I fix the call and retry."
