"""Off-plan detours of the Memex expert: recoverable mistakes in demonstrations, not learned themselves.

A policy trained only on a perfect expert never sees the states its own mistakes lead to: after
SFT on clean demonstrations, SmolLM2 loops, its working context grows far past T, and it has
never seen a demonstration compress there (the expert's contexts rarely pass 0.8 T). So, with
probability `expert.detour_rate` at an env action, the expert first makes one of these moves:

- `wander`: go to a receptacle of the room overview it has no plan for;
- `revisit`: go back to a receptacle it already checked (its contents are in the context);
- `repeat`: do the last env action again (a loop; it usually answers "Nothing happens.").

The detour turn is played (its observation stays in the context and W grows) but carries loss
mask 0 (`Completion.trained`), so SFT learns what comes after it — compressing past 0.8 T,
reading back names that left the context, returning to the plan — and never the detour itself:
noise injection in the demonstrator, as in DART (Laskey et al., 2017). The handcoded ALFWorld
planner re-plans from any position (`go to` resets its place; failed actions change nothing),
so the episode still ends in success as often as the step limit allows. The paper does not
describe its demonstrations; `expert.detour_rate: 0` gives the clean expert.
"""

from __future__ import annotations

import random

DETOUR_KINDS = ("wander", "revisit", "repeat")
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
