"""What the Memex expert knows of an ALFWorld game: only what the episode has shown (sft/expert.py).

`WorldNotes` is rebuilt from the trajectory's steps at every turn (the room overview from `look`,
what was seen in which receptacle, what is held, heated, placed, and the latest milestone);
`Targets` are the task's target classes from the game's PDDL parameters (the goal names them);
the helpers read object and receptacle names out of actions and observations.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from memory.context import without_status
from memory.parsing import EXECUTE_ACTION, READ

_NOTHING = "Nothing happens."
_ARGS = [re.compile(p) for p in (
    r"(?:go to|open|close|examine|use) (?P<a>.+)",
    r"take (?P<a>.+?) from (?P<b>.+)",
    r"move (?P<a>.+?) to (?P<b>.+)",
    r"(?:heat|cool|clean|slice) (?P<a>.+?) with (?P<b>.+)",
)]  # fmt: skip
TRANSFORMS = {"heat": "heated", "cool": "cooled", "clean": "cleaned", "slice": "sliced"}
APPLIANCE = {"heat": "microwave", "cool": "fridge", "clean": "sinkbasin"}
NEEDS = {"pick_heat_then_place_in_recep": "heat", "pick_cool_then_place_in_recep": "cool",
          "pick_clean_then_place_in_recep": "clean"}  # fmt: skip


def action_names(action: str) -> list[str]:
    """The object and receptacle names an ALFWorld command refers to (e.g. take A from B -> [A, B])."""
    for pattern in _ARGS:
        match = pattern.fullmatch(action.strip())
        if match:
            return [n for n in match.groupdict().values() if n]
    return []


def name_class(name: str) -> str:
    """'apple 2' -> 'apple' (standard ALFWorld names); raw PDDL names are returned as they are."""
    return re.sub(r" \d+$", "", name)


def mentions(text: str, name: str) -> bool:
    """Whether `name` occurs in `text` as a whole name ('apple 1' is not in 'pineapple 1' or 'apple 10')."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def seen_items(body: str) -> list[str] | None:
    """The objects listed by an observation ('..., you see a apple 1, and a mug 2.'), None if it lists none."""
    if "you see " not in body:
        return None
    listed = body.rsplit("you see ", 1)[1].rstrip(".").strip()
    if listed == "nothing":
        return []
    parts = re.split(r",\s*(?:and\s+)?|\s+and\s+", listed)
    return [re.sub(r"^(?:a|an)\s+", "", p.strip()) for p in parts if p.strip()]


def body_of(observation: str) -> str:
    """An observation without the context status the agent loop appends."""
    return without_status(observation)


@dataclass(frozen=True)
class Targets:
    """The task's classes (from the game's traj_data.json: the goal says the same in words)."""

    obj: str = ""
    parent: str = ""
    toggle: str = ""

    @classmethod
    @functools.lru_cache(maxsize=256)
    def of_game(cls, game: str) -> Targets:
        try:
            params = json.loads((Path(game).parent / "traj_data.json").read_text())["pddl_params"]
        except (OSError, ValueError, KeyError):
            return cls()
        return cls(*(str(params.get(k) or "").lower() for k in ("object_target", "parent_target", "toggle_target")))

    def interesting(self) -> list[str]:
        return [c for c in (self.obj, self.toggle) if c]


@dataclass
class WorldNotes:
    """What the episode has shown so far, read back from its steps (the expert's own memory)."""

    room: str = ""
    looked: bool = False
    contents: dict[str, list[str]] = field(default_factory=dict)  # receptacle -> objects last seen there
    checked: list[str] = field(default_factory=list)  # receptacles whose contents were seen
    held: str | None = None
    location: str = ""  # the receptacle the agent went to last
    states: dict[str, list[str]] = field(default_factory=dict)  # object -> heated / cooled / ...
    placed: list[tuple[str, str]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)  # milestones, in words
    milestone: str | None = None  # the milestone of the newest step, when it was one
    env_since_compress: int = 0
    segment_obs: list[tuple[str, str]] = field(default_factory=list)  # (receptacle, body) of this segment
    room_in_segment: bool = False
    read_in_segment: set[str] = field(default_factory=set)

    @classmethod
    def from_steps(cls, steps: list) -> WorldNotes:
        notes = cls()
        for step in steps:
            notes._take(step)
        return notes

    def _take(self, step) -> None:
        self.milestone = None
        if step.compressed:
            self.env_since_compress, self.segment_obs, self.room_in_segment = 0, [], False
            self.read_in_segment = set()
            return
        if step.tool == READ and step.error is None:
            self.read_in_segment.add(step.arguments["db_index"])
            return
        if step.tool != EXECUTE_ACTION or step.format_error or step.error:
            return
        self.env_since_compress += 1
        action, body = step.arguments["action"].strip(), body_of(step.observation)
        if action == "look":
            if not self.looked and body.startswith("You are in the middle of a room"):
                self.room, self.room_in_segment = body, True
            self.looked = True
            return
        if body.startswith(_NOTHING):
            return
        names = action_names(action)
        verb = action.split(" ", 1)[0]
        if verb == "go" and names:
            self.location = names[0]
        items = seen_items(body)
        if items is not None and verb in ("go", "open", "examine") and names:
            self.contents[names[0]] = items
            if names[0] not in self.checked:
                self.checked.append(names[0])
            self.segment_obs.append((names[0], body))
        if verb == "take" and len(names) == 2:
            self.held = names[0]
            if names[0] in self.contents.get(names[1], []):
                self.contents[names[1]].remove(names[0])
            self._milestone(f"took {names[0]} from {names[1]}")
        elif verb == "move" and len(names) == 2:
            self.held = None
            self.placed.append((names[0], names[1]))
            self.contents.setdefault(names[1], []).append(names[0])
            self._milestone(f"put {names[0]} in/on {names[1]}")
        elif verb in TRANSFORMS and len(names) == 2:
            self.states.setdefault(names[0], []).append(TRANSFORMS[verb])
            self._milestone(f"{TRANSFORMS[verb]} {names[0]} with {names[1]}")
        elif verb == "use" and names:
            self._milestone(f"turned on {names[0]}")

    def _milestone(self, text: str) -> None:
        self.milestone = text
        self.done.append(text)

    def where_seen(self, cls: str) -> list[tuple[str, str]]:
        """(object, receptacle) for every object of class `cls` last seen somewhere (not held)."""
        return [(o, r) for r, objs in self.contents.items() for o in objs if name_class(o) == cls and o != self.held]
