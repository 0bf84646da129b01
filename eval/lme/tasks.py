"""`memexrl lme tasks`: reading tasks (envs/reading.py) from a synthetic LME-V2 set, one per question.

A task holds one question, its evidence trajectories (`synth_evidence.json` of `memexrl lme synth`) and
`distractors` other trajectories of the question's haystack (same domain), all in haystack order -- the
timeline, so an edit still comes after the view it changes -- and the planted answer strings the reward
looks for (rewards/reading.py). Training sets come from `lme synth` with training seeds; the held-out
evaluation is `memexrl eval lme` on a seed no task was made from.

Writes OUT/<question id>.json (self-contained: the env needs nothing else) and OUT/games.txt listing them
(relative to OUT), the games file `train.reading_tasks` takes; `--prefix` names the tasks of several seeds apart.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from common.atomic import write_text_atomic
from common.errors import MemexError
from envs.data import GAMES_FILE
from envs.reading import READING_KIND, load_reading_task
from eval.lme.data import load_lme
from eval.lme.synth import EVIDENCE_FILE


def reading_tasks(data_root: str | Path, distractors: int, states_per_page: int, state_max_chars: int,
                  max_reads: int, shortlist: int, seed: int, prefix: str = "", haystack: str = "small",
                  page_end: str = "") -> list[dict]:
    """The tasks of every question of the set that has planted evidence (see the module docstring); `page_end`:
    the line closing every page (envs/reading.py; "" for none)."""
    data = load_lme(data_root)
    path = data.root / EVIDENCE_FILE
    if not path.is_file():
        raise MemexError(f"{data.root} has no {EVIDENCE_FILE}: reading tasks need the planted evidence that "
                         "`memexrl lme synth` records; make the set with it")
    evidence = json.loads(path.read_text(encoding="utf-8"))
    hay = data.haystack(haystack)
    rng = random.Random(seed)
    tasks = []
    for q in data.questions_in(hay):
        ev = evidence.get(q.id) or {}
        needles = [str(n[-1]) for n in ev.get("needles", [])]
        own = [t for t in ev.get("trajectories", []) if t in data.trajectories]
        if not needles or not own:
            continue
        others = [t for t in hay[q.id] if t not in own]
        chosen = set(own) | set(rng.sample(others, min(distractors, len(others))))
        order = [t for t in hay[q.id] if t in chosen] + [t for t in own if t not in hay[q.id]]
        tasks.append({"kind": READING_KIND, "id": f"{prefix}{q.id}", "domain": q.domain, "question": q.question,
                      "question_type": q.question_type, "answer": q.answer, "evidence": sorted(set(needles)),
                      "evidence_trajectories": own, "evidence_states": [list(n) for n in ev["needles"]],
                      "states_per_page": states_per_page,
                      "state_max_chars": state_max_chars, "max_reads": max_reads, "shortlist": shortlist,
                      **({"page_end": page_end} if page_end else {}),
                      "trajectories": [data.trajectories[t] for t in order]})
    if not tasks:
        raise MemexError(f"no question of {data.root} has planted evidence in {EVIDENCE_FILE}")
    return tasks


def write_tasks(out: str | Path, tasks: list[dict]) -> Path:
    """OUT/<id>.json for each task, then OUT/games.txt (written last: it lists only complete files)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for task in tasks:
        name = f"{task['id']}.json"
        write_text_atomic(out / name, json.dumps(task) + "\n")
        load_reading_task(out / name)  # what the env will read, checked now
        names.append(name)
    games = out / GAMES_FILE
    write_text_atomic(games, "".join(n + "\n" for n in names))
    return games


def tasks_command(data: str, out: str, distractors: int, states_per_page: int, state_max_chars: int,
                  max_reads: int, shortlist: int, seed: int, prefix: str, page_end: str = "") -> str:
    tasks = reading_tasks(data, distractors, states_per_page, state_max_chars, max_reads, shortlist, seed, prefix,
                          page_end=page_end)
    games = write_tasks(out, tasks)
    states = [sum(len(t["states"]) for t in task["trajectories"]) for task in tasks]
    sizes = [len(task["trajectories"]) for task in tasks]
    return (f"Wrote {len(tasks)} reading tasks to {out} ({min(sizes)}-{max(sizes)} trajectories, "
            f"{min(states)}-{max(states)} states a task); "
            f"train on them with train.env=reading train.reading_tasks={games}")
