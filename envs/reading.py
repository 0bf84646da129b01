"""The reading env (issue 27): page through web-agent trajectories, archive, then answer one question from memory.

The training counterpart of the LME-V2 memory controller (eval/lme/memory/memex.py), with the ALFWorld env's
interface (`reset() -> (obs, info)`, `step(action) -> (obs, reward, terminated, truncated, info)`), so the
agent loop, the env pool, segmentation and GRPO run unchanged. One task is one JSON file (`READING_KIND`,
written by `memexrl lme tasks` from an LME-V2-schema data set): a question, the trajectories to read (the ones
holding its planted evidence among distractors of the same domain) and the planted answer strings.

1. Reading. The task message says how many trajectories and states follow and that a question comes after
   them. Every `execute_action` (any action: paging is the only action) shows the next `states_per_page`
   states, each as the controller shows it (`State k` + thought + action + AXTree, capped at
   `state_max_chars`), a trajectory's first state after its header (goal, start URL, outcome), and the task's
   `page_end` line when it has one (ours, `lme tasks --page-end`: a constant last line that an anchor block's
   end_anchor can name, as the tool takes the nearest end after the mid anchor: docs/results.md section 3). The question
   is hidden while reading, as it is when the controller inserts a haystack. Working context passes T: the
   agent compresses (CompressExperience), archiving what a question may need under indices that say what
   they hold.
2. The question. The `execute_action` after the last page asks it: the answer's info carries
   `new_context` and `catalog`, and the agent loop (rollout/episode.py) starts a fresh working context --
   a new segment -- holding only the question and the catalog of the archived blocks (memory/catalog.py:
   index and description, a bm25 shortlist of `shortlist` of them), the controller's query message. What
   the agent did not archive is gone. It reads at most `max_reads` blocks with ReadExperience, then calls
   finish; execute_action now only repeats that there are no more states.

The env never sees the memory tools (the agent loop runs them). R_task -- the share of the planted strings
that the blocks read after the question bring to the reader, the evidence-recall diagnostic of `eval lme`
per question -- is computed from the finished trajectory by rewards/reading.py; reset's info carries the
strings under `task` (the trajectory keeps them; the policy never sees them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import MemexError
from common.trajectory import READING_TASK
from envs.lme_records import render_state

READING_KIND = "memexrl-reading-task"
QUESTION_HEADER = "Question:"
NO_MORE_STATES = ("There are no more states: the question has been asked. Read the archived blocks you need "
                  "with ReadExperience, then call finish.")
LAST_PAGE_NOTE = ("That was the last state. Archive what a question may need with CompressExperience now; "
                  "then call execute_action to get the question.")


def load_reading_task(path: str | Path) -> dict:
    """A task file, checked: a broken or foreign file stops with one message naming it and what to fix."""
    file = Path(path).expanduser()
    try:
        task = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MemexError(f"cannot read the reading task {file} ({type(e).__name__}: {e}): "
                         "`memexrl lme tasks` writes these files") from None
    if not isinstance(task, dict) or task.get("kind") != READING_KIND:
        raise MemexError(f"{file} is not a reading task (no \"kind\": \"{READING_KIND}\"): "
                         "`memexrl lme tasks` writes these files")
    for key, kind in (("id", str), ("question", str), ("question_type", str), ("trajectories", list),
                      ("evidence", list), ("states_per_page", int), ("state_max_chars", int), ("max_reads", int),
                      ("shortlist", int)):
        if not isinstance(task.get(key), kind) or isinstance(task.get(key), bool):
            raise MemexError(f"{file}: field {key!r} must be a {kind.__name__}, got {json.dumps(task.get(key))[:60]}")
    if not task["trajectories"] or not all(isinstance(t, dict) and isinstance(t.get("states"), list)
                                           and t["states"] for t in task["trajectories"]):
        raise MemexError(f"{file}: `trajectories` must be a non-empty list of trajectories with states")
    if not isinstance(task.get("page_end", ""), str):
        raise MemexError(f"{file}: field 'page_end' must be a str, got {json.dumps(task.get('page_end'))[:60]}")
    if min(task["states_per_page"], task["state_max_chars"], task["max_reads"], task["shortlist"]) < 1:
        raise MemexError(f"{file}: states_per_page, state_max_chars, max_reads and shortlist must be >= 1")
    return task


def question_message(question: str, max_reads: int) -> str:
    """What the agent reads at the question (the catalog follows it, memory/catalog.py); the LME-V2 controller's
    query shows the same."""
    return (f"{QUESTION_HEADER} {question}\nRead the archived blocks that hold the answer (at most {max_reads}) "
            "with ReadExperience, then call finish.")


def trajectory_header(trajectory: dict, number: int, total: int) -> str:
    """What precedes a trajectory's first state: which one, its goal, start URL and outcome."""
    return (f"Trajectory {number} of {total} (id {trajectory.get('id', '')}): goal: {trajectory.get('goal', '')}\n"
            f"Start URL: {trajectory.get('start_url', '')}\nOutcome: {trajectory.get('outcome') or 'unknown'}")


class ReadingEnv:
    """One reading task as an env (see the module docstring)."""

    def __init__(self, task: str | Path | dict, **_alfworld_options: Any):
        """`task`: a task file, or the task itself (the LME-V2 controller pages a haystack's trajectory)."""
        self.task_file = str(task.get("id", "")) if isinstance(task, dict) else str(task)
        self.task = task if isinstance(task, dict) else load_reading_task(task)
        trajectories = self.task["trajectories"]
        self.pages = self._paginate(trajectories, self.task["states_per_page"])
        self.position = 0
        self.asked = False

    @staticmethod
    def _paginate(trajectories: list[dict], per_page: int) -> list[list[tuple[int, int]]]:
        """(trajectory, state) pairs a page; a page never spans two trajectories."""
        pages = []
        for j, trajectory in enumerate(trajectories):
            states = range(len(trajectory["states"]))
            pages += [[(j, k) for k in states[i:i + per_page]] for i in range(0, len(states), per_page)]
        return pages

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {"game": self.task_file, "task_type": f"{READING_TASK}/{self.task['question_type']}",
                "goal": "read the trajectories, then answer a question from memory", "won": False, **extra}

    def reset(self, *, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self.position, self.asked = 0, False
        trajectories = self.task["trajectories"]
        n_states = sum(len(t["states"]) for t in trajectories)
        what = "1 trajectory" if len(trajectories) == 1 else f"{len(trajectories)} trajectories"
        obs = (f"You will read {what} of a web agent ({n_states} states in all), "
               f"{self.task['states_per_page']} states at a time: call execute_action with any action (e.g. "
               f"\"next\") to see the next states. Then a colleague asks one question about these environments. "
               "Your working context is cleared for it: only the blocks you archived with CompressExperience "
               "remain, listed by db_index and description, and you read back the ones you need. Archive what a "
               "question may ask: page contents and values, how values changed, procedures that worked, errors "
               "and their fixes.")
        info = self._info(task={"kind": READING_TASK, "id": self.task["id"], "evidence": self.task["evidence"],
                                "evidence_states": self.task.get("evidence_states", []),
                                "max_reads": self.task["max_reads"]})
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.asked:
            return NO_MORE_STATES, 0.0, False, False, self._info(advances=False)  # a repeat is a repeat now
        if self.position >= len(self.pages):
            self.asked = True
            catalog = {"query": self.task["question"], "shortlist": self.task["shortlist"]}
            return (question_message(self.task["question"], self.task["max_reads"]), 0.0, False, False,
                    self._info(advances=True, new_context=True, catalog=catalog))
        page = self.pages[self.position]
        self.position += 1
        trajectories = self.task["trajectories"]
        parts = []
        for j, k in page:
            if k == 0:
                parts.append(trajectory_header(trajectories[j], j + 1, len(trajectories)))
            parts.append(render_state(trajectories[j], k, self.task["state_max_chars"]))
        if self.task.get("page_end"):
            parts.append(self.task["page_end"])
        if self.position == len(self.pages):
            parts.append(LAST_PAGE_NOTE)
        return "\n\n".join(parts), 0.0, False, False, self._info(advances=True)

    def close(self) -> None:
        pass

    def __enter__(self) -> ReadingEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
