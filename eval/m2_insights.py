"""M²'s external memory for ALFWorld: an insight bank distilled from successful trajectories (m2.md).

M² distils insights offline from successful trajectories, strips task-specific literals, keys
them by the task query, embeds the keys with a sentence-transformer and injects the top 5 by
cosine similarity into the system prompt, as suggestions to check against what the agent sees.
Here the trajectories are ALFWorld ones (the Memex expert's demonstrations, or any policy's
successful episodes, in trajectory JSON) and the distillation is a deterministic reading of
each trajectory's env actions, with object numbers removed ("apple 2" -> "apple"):

    put a clean apple in fridge: a apple was found at countertop (after checking cabinet, drawer);
    clean it with sinkbasin; open fridge first; put it in/on fridge.

The paper distils with an LLM; rules keep this baseline cheap and reproducible on a CPU, and
free of a second model (a switch for LLM-written insights is left for when one is wanted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import MemexError
from common.jsonl import read_jsonl
from eval.embeddings import DEFAULT_EMBEDDER, embed, top_k

TOP_K = 5  # m2.md: 5 insights beat 3 or 7
_ID = re.compile(r" \d+\b")
_TRANSFORMS = ("heat", "cool", "clean", "slice")


def strip_ids(text: str) -> str:
    """'take apple 2 from countertop 1' -> 'take apple from countertop' (the literals of one game)."""
    return _ID.sub("", text)


def env_actions(trajectory: dict) -> list[str]:
    """The env actions that did something ('Nothing happens.' excluded), ids stripped, in order."""
    out = []
    for step in trajectory.get("steps", []):
        if step.get("tool") != "execute_action" or step.get("format_error") or step.get("error"):
            continue
        if step.get("observation", "").startswith("Nothing happens"):
            continue
        out.append(strip_ids(str((step.get("arguments") or {}).get("action", "")).strip()))
    return out


def distill(trajectory: dict) -> tuple[str, str] | None:
    """(key, insight) of one successful trajectory: the task query and what solved it; None otherwise."""
    if not trajectory.get("success"):
        return None
    goal = strip_ids(str(trajectory.get("goal", "")).strip().rstrip("."))
    actions = env_actions(trajectory)
    facts, checked = [], []
    for action in actions:
        verb, _, rest = action.partition(" ")
        if verb == "go" and rest.startswith("to "):
            place = rest[3:]
            if place not in checked:
                checked.append(place)
        elif verb == "take" and " from " in rest:
            obj, place = rest.split(" from ", 1)
            before = [c for c in checked if c != place]
            facts.append(f"a {obj} was found at {place}" + (f" (after checking {', '.join(before[-3:])})" if before else ""))
            checked = []
        elif verb in _TRANSFORMS and " with " in rest:
            facts.append(f"{verb} it with {rest.split(' with ', 1)[1]}")
        elif verb == "open":
            facts.append(f"open {rest} first")
        elif verb == "use":
            facts.append(f"turn on {rest}")
        elif verb == "move" and " to " in rest:
            facts.append(f"put it in/on {rest.split(' to ', 1)[1]}")
    if not goal or not facts:
        return None
    return goal, f"{goal}: {'; '.join(dict.fromkeys(facts))}."


@dataclass
class InsightBank:
    """Insights keyed by task query, retrieved by cosine similarity of sentence embeddings."""

    keys: list[str]
    insights: list[str]
    embedder: str = DEFAULT_EMBEDDER
    vectors: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.vectors is None:
            self.vectors = embed(self.keys, self.embedder) if self.keys else np.zeros((0, 0), np.float32)

    @classmethod
    def from_trajectories(cls, paths: list[str | Path], embedder: str = DEFAULT_EMBEDDER) -> InsightBank:
        """Distil every successful trajectory of the JSONL files (demos.jsonl, episodes.jsonl); one insight
        per distinct text."""
        found: dict[str, str] = {}
        for path in paths:
            for _, traj in read_jsonl(Path(path), "trajectories for the M² insight bank not found (write them with "
                                      "`memexrl expert --out DIR` or `memexrl eval alfworld`)", "trajectory JSON"):
                item = distill(traj) if isinstance(traj, dict) else None
                if item is not None:
                    found.setdefault(item[1], item[0])
        if not found:
            raise MemexError(f"no successful trajectory to distil insights from in {', '.join(map(str, paths))}")
        return cls(keys=list(found.values()), insights=list(found), embedder=embedder)

    def retrieve(self, query: str, k: int = TOP_K) -> tuple[str, ...]:
        """The `k` insights whose task is most similar to `query` (a task goal), best first."""
        if not self.insights:
            return ()
        return tuple(self.insights[i] for i in top_k(embed([query], self.embedder)[0], self.vectors, k))

    def save(self, path: str | Path) -> None:
        """JSON (keys, insights, the embedder's name); embeddings are recomputed on load."""
        Path(path).write_text(json.dumps({"embedder": self.embedder, "keys": self.keys, "insights": self.insights},
                                         indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> InsightBank:
        try:
            data = json.loads(Path(path).read_text())
            return cls(keys=list(data["keys"]), insights=list(data["insights"]), embedder=data["embedder"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise MemexError(f"{path} is not an insight bank written by InsightBank.save ({e})") from None
