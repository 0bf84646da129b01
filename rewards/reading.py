"""R_task of a reading episode (issue 27): the share of the question's planted evidence that reaches the reader.

The reading env (envs/reading.py) asks its question in a fresh working context that lists the archive; the
reader of LME-V2 later gets the blocks the controller read back, nothing else (eval/lme/memory/memex.py). So
the task reward is the evidence-recall diagnostic of `memexrl eval lme`, per question: of the distinct planted
answer strings (the trajectory's `task["evidence"]`), the share found in the blocks that the first
`task["max_reads"]` successful ReadExperience calls after the question read (a block read twice counts once).
Reads before the question do not reach the reader; an episode that never got to the question scores 0.

A string is found when it occurs in a block's content as a whole word or phrase (`evidence_found`): a planted
"8" is not found inside "812". `eval lme` checks its contexts with the same function.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from common.trajectory import Trajectory
from memory.parsing import READ


def evidence_found(text: str, needles: Iterable[str]) -> list[bool]:
    """For each needle: does it occur in `text` with no word character right before or after it."""
    return [re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text) is not None for n in needles]


def indices_read_after_question(traj: Trajectory) -> list[str]:
    """The indices the successful ReadExperience calls after the question read, distinct, within the read
    budget: the blocks the reader gets."""
    asked = traj.task.get("question_step")
    if asked is None:
        return []
    read: list[str] = []
    for step in traj.steps[asked + 1:]:
        if step.tool == READ and step.error is None and not step.format_error:
            index = str((step.arguments or {}).get("db_index", ""))
            if index not in read:
                read.append(index)
            if len(read) >= int(traj.task.get("max_reads", 1)):
                break
    return read


def evidence_recall(traj: Trajectory) -> float:
    """The share of the distinct planted strings found in the blocks read after the question."""
    needles = sorted({str(n) for n in traj.task.get("evidence", []) if str(n)})
    if not needles:
        return 0.0
    text = "\n\n".join(traj.experience.get(i, "") for i in indices_read_after_question(traj))
    return sum(evidence_found(text, needles)) / len(needles)
