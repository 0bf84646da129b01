"""`m2`: M²'s external memory as an LME-V2 module, an insight bank over the haystack (m2.md).

M² distils insights offline from successful trajectories (search terms and filters, useful
navigation entry points, waiting/verification rules), strips task-specific literals, keys each
by its task query, embeds the keys with a sentence-transformer and hands the top 5 by cosine
similarity to the agent as suggestions to check, never as macros. Here (as eval/m2_insights.py
does for ALFWorld):

- only trajectories whose `outcome` says they succeeded are distilled (`succeeded`); one insight
  per trajectory, identical insights kept once;
- the insight is written by `options.llm` when given (one call per successful trajectory), else
  by rules (`distill`): the goal, the start URL, then the click/fill/select path with element ids
  stripped (`click button 'Save'`; typed values dropped, as literals of one task);
- the key is the trajectory's goal, embedded with `options.embedder` (the MiniLM sentence-
  transformer by default); the question is the query; the top `options.insight_top_k` (5) insights
  come back as one text item that presents them as suggestions to verify.
"""

from __future__ import annotations

import ast
import re

from .base import register, text_item
from .index import PooledMemory
from .notes import outcome_text
from .slices import truncate_middle

INSIGHT_SECTION = ("## Insights from Similar Successful Tasks in the Environment\n"
                   "These are suggestions distilled from past runs: check each against the other evidence; "
                   "they may not apply.\n\n")
INSIGHT_PROMPT = """You distil reusable insights from one successful run of a web task, for a future agent
doing similar tasks in the same application: the search terms and filters that worked, useful
navigation entry points (menus, pages, URLs), and rules for waiting or verifying results.
Drop the literals of this one task (names, numbers, dates, typed values). Reply with 2 to 5 short
'- ' bullets and nothing else."""
MAX_STEPS = 15  # rule insights list at most this many steps
_FAILED = re.compile(r"\b(fail\w*|unsuccessful\w*|not (?:successful|succeed\w*|completed?|achieved)|incomplete|"
                     r"infeasible|abandon\w*)\b")
_SUCCEEDED = re.compile(r"\b(success\w*|succeed\w*|completed?|achieved|accomplished|passed|solved|true)\b")
_ID_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*")


def succeeded(outcome: object) -> bool:
    """Whether a trajectory's `outcome` (free text or null in the data) says it succeeded."""
    if isinstance(outcome, bool):
        return outcome
    text = str(outcome or "").lower()
    return bool(_SUCCEEDED.search(text)) and not _FAILED.search(text)


def step_text(annotated: str) -> str | None:
    """`click('a12')  # [a12] button 'Save'` -> "click button 'Save'"; None for steps that change nothing."""
    action, _, detail = annotated.partition("  # ")
    element = _ID_PREFIX.sub("", detail.split(" | ")[0]).strip() or "an element"
    try:
        call = ast.parse(action.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(call, ast.Call):
        return None
    name = getattr(call.func, "id", getattr(call.func, "attr", ""))
    args = [a.value for a in call.args if isinstance(a, ast.Constant)]
    if name in ("click", "dblclick"):
        return f"click {element}"
    if name in ("fill", "type", "clear"):
        return f"fill {element}"
    if name == "select_option":
        return f"choose an option in {element}"
    if name in ("check", "uncheck"):
        return f"{name} {element}"
    if name == "press" and len(args) > 1:
        return f"press {args[1]} in {element}"
    if name == "goto" and args:
        return f"go to {str(args[0]).split('?')[0]}"
    if name in ("go_back", "go_forward", "tab_focus", "new_tab"):
        return name.replace("_", " ")
    return None  # scroll, noop, hover, send_msg_to_user, report_infeasible, ...


def distill(traj: dict) -> str:
    """The rule-made insight of a stored trajectory (slices.simplify form)."""
    steps: list[str] = []
    for annotated in traj["annotated"]:
        step = step_text(annotated)
        if step and (not steps or steps[-1] != step):
            steps.append(step)
    if len(steps) > MAX_STEPS:
        steps = steps[:MAX_STEPS] + ["..."]
    path = " -> ".join(steps) if steps else "no recorded interaction"
    return f"{traj['goal'].strip().rstrip('.')}: start at {traj['start_url'] or 'the start page'}; {path}."


def insight_messages(traj: dict) -> list[dict]:
    thoughts = " ".join(s["thought"] for s in traj["states"] if s["thought"])
    user = "\n".join([f"Goal: {traj['goal']}", f"Start URL: {traj['start_url']}", f"Outcome: {outcome_text(traj)}",
                      "Actions:", *(f"{k}. {a}" for k, a in enumerate(traj["annotated"], 1)),
                      f"Agent's thoughts: {truncate_middle(thoughts, 3000) or '<none>'}"])
    return [{"role": "system", "content": INSIGHT_PROMPT}, {"role": "user", "content": user}]


@register
class M2Memory(PooledMemory):
    """Insights from the haystack's successful trajectories, retrieved by goal similarity (m2.md)."""

    name = "m2"
    pool_names = ("insights",)
    keeps_trajectories = False

    def insert(self, trajectory: dict) -> None:
        traj = self.add_trajectory(trajectory)
        if not succeeded(traj["outcome"]):
            return
        insight = ""
        if self.options.llm is not None:
            reply = self.options.llm.complete(insight_messages(traj)).strip()
            insight = f"{traj['goal'].strip().rstrip('.')}:\n{reply}" if reply else ""
        insight = insight or distill(traj)
        pool = self.pools["insights"]
        if any(p["insight"] == insight for p in pool.payloads):
            return
        pool.add(traj["goal"], {"id": f"{traj['id']}:insight", "tid": traj["id"], "goal": traj["goal"],
                                "insight": insight})

    def query(self, question: str, question_image: str | None = None) -> list[dict]:
        self.flush()
        vector = self.embed_queries([question]).get(question)
        hits = self.pools["insights"].search(vector, self.options.insight_top_k, question) if vector is not None else []
        if not hits:
            return []
        lines = [f"{i}. {hit.payload['insight']}" for i, hit in enumerate(hits, start=1)]
        return [text_item(INSIGHT_SECTION + "\n\n".join(lines) + "\n")]
