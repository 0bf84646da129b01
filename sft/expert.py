"""The Memex expert: demonstrations that use the memory tools correctly (paper 4.8-4.9, "SFT warm start").

`MemexExpertEngine` plays the modified ALFWorld (memex.md "Modified ALFWorld") by following the
handcoded ALFWorld expert's plan (`info["expert_plan"]`), and wraps its env actions in the Memex
behaviour the policy should learn:

- `look` once, first (the env never offers a second one: envs/alfworld.py);
- `CompressExperience` at natural phase boundaries (target found and picked up, object put down,
  heated, cooled, cleaned, sliced; at least MIN_STEPS_BETWEEN_COMPRESSIONS env actions apart; off with
  `expert.milestone_compress: false`) and whenever W passes warn_ratio * T (memex.md "Context status"),
  with an index-map summary that names every index of the store (memex.md: carry indices over);
- exact evidence archived by anchor mode (the room overview from `look`, the observations where
  the target objects were seen: start/mid/end anchors copied from the working context and checked
  with memory/anchors.py before the call) and derived facts by explicit mode (what is held,
  where the targets are, what was checked);
- `ReadExperience` before an action that names an object or receptacle absent from the working
  context but present in an archived block, instead of exploring again.

Every turn is a one- or two-sentence thought followed by exactly one tool call, tokenised by
`ScriptedEngine` as if the policy had written it; the expert writes its script turn by turn from
the live episode (`GenerationRequest.state`). Only what the episode has shown goes into the texts:
the observations seen so far (`WorldNotes`), the goal, and the task's target classes. The expert
stops (the episode ends as `script_exhausted`, counted in `stops`) when the handcoded expert has no
plan left, or when its next action names something the agent has never been shown (one of its
random moves, which no policy could learn from the context).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter

from common.engine import GenerationRequest
from memory.anchors import extract_span
from memory.parsing import COMPRESS, EXECUTE_ACTION, READ, render_tool_call
from rollout.scripted import ScriptedEngine
from sft.dataset import game_id
from sft.detours import (
    break_compress,
    choose_detour,
    detour_rng,
    detour_thought,
    malform_call,
    recovery_thought,
)
from sft.world import (
    APPLIANCE,
    NEEDS,
    TRANSFORMS,
    Targets,
    WorldNotes,
    action_names,
    mentions,
    name_class,
    seen_items,
)

log = logging.getLogger(__name__)

ROOM_INDEX = "room"
FACTS_INDEX = "facts"
MIN_STEPS_BETWEEN_COMPRESSIONS = 3  # env actions since the last compression before a boundary compresses


class MemexExpertEngine(ScriptedEngine):
    """The Memex expert as an engine: each request's episode (`req.state`) decides the next turn."""

    def __init__(self, tokenizer, detour_rate: float = 0.0, max_detours: int = 4, seed: int = 0,
                 rejected_compress_rate: float = 0.0, max_turn_tokens: int = 0, milestone_compress: bool = True,
                 seen_evidence: str = "anchor", anchor_end: str = "words"):
        super().__init__(tokenizer, {})
        self.anchor_end = anchor_end  # expert.anchor_end: "words" (the last words) or "sentence" (".")
        self.seen_evidence = seen_evidence  # "anchor": <class>_seen blocks; "facts": the facts block only
        self.milestone_compress = milestone_compress  # False: compress only past warn_ratio * T
        self.max_turn_tokens = max_turn_tokens  # 0: the request's max_new_tokens
        # Why episodes were stopped: "no_plan" (the handcoded expert gave up) or "unseen_name" (its next
        # action names something neither in the context nor in the store: a random move the policy
        # could not have made, so the demonstration ends there).
        self.stops: Counter[str] = Counter()
        # Off-plan detours (sft/detours.py): played, never trained.
        self.detour_rate, self.max_detours, self.seed = detour_rate, max_detours, seed
        self.rejected_compress_rate = rejected_compress_rate  # rejected compressions first (sft/detours.py)
        self.detours: Counter[str] = Counter()  # by kind, over all episodes
        self._detours_in: Counter[str] = Counter()  # by episode id
        self._untrained: set[str] = set()  # episodes whose current turn is a detour

    def generate(self, requests: list[GenerationRequest]):
        for req in requests:
            if req.state is None:
                raise ValueError("MemexExpertEngine needs the episode in GenerationRequest.state")
            cap = req.max_new_tokens if self.max_turn_tokens <= 0 else min(req.max_new_tokens, self.max_turn_tokens)
            text = self.next_turn(req.state, cap)
            if text is not None:  # None: no plan left, the script runs out and the episode ends
                self.scripts.setdefault(req.episode_id, []).append(text)
        completions = super().generate(requests)
        for i, req in enumerate(requests):
            if req.episode_id in self._untrained:
                self._untrained.discard(req.episode_id)
                completions[i] = dataclasses.replace(completions[i], trained=False)
        return completions

    def release(self, episode_id: str) -> None:
        super().release(episode_id)
        self.scripts.pop(episode_id, None)
        self._detours_in.pop(episode_id, None)

    # --- one turn ---------------------------------------------------------------------------------
    def next_turn(self, ep, budget: int) -> str | None:
        """The assistant text of the episode's next turn, within `budget` tokens."""
        steps = ep.traj.steps
        notes = WorldNotes.from_steps(steps)
        if not notes.looked:
            return self._fit(["I should look around first to see the room and its receptacles."],
                             EXECUTE_ACTION, {"action": "look"}, budget)
        plan = list(ep.last_info.get("expert_plan") or [])
        if not plan or plan[0] == "look":
            log.debug("episode %s: the handcoded expert has no plan left", ep.id)
            self.stops["no_plan"] += 1
            return None
        action = plan[0]
        targets = Targets.of_game(ep.traj.game)
        reason = self._compress_reason(ep, notes)
        if reason is not None:
            text = self._compress_turn(ep, notes, targets, action, budget, reason)
            if text is not None:
                return text
        context = "\n\n".join(m["content"] for m in ep.context.messages[1:])
        missing = [n for n in action_names(action) if not mentions(context, n)]
        if missing:
            unread = {i: ep.store.read(i).content for i in ep.store.indices() if i not in notes.read_in_segment}
            index = block_for(unread, missing, sought_class(ep.traj.task_type, notes, targets))
            if index is not None:
                thought = (f"I need the exact name of the {name_class(missing[0])}; my archived block "
                           f"'{index}' has it, so I read it back instead of exploring again.")
                return self._fit([thought, "Read it back."], READ, {"db_index": index}, budget)
            log.debug("episode %s: %r names %s, seen nowhere: stopped", ep.id, action, missing)
            self.stops["unseen_name"] += 1
            return None
        detour = self._detour(ep, notes, action)
        if detour is not None:
            kind, off_plan = detour
            self.detours[kind] += 1
            self._detours_in[ep.id] += 1
            self._untrained.add(ep.id)
            return self._fit([detour_thought(kind, off_plan)], EXECUTE_ACTION, {"action": off_plan}, budget)
        return self._fit([act_thought(action, notes, targets), ""], EXECUTE_ACTION, {"action": action}, budget)

    def _detour(self, ep, notes: WorldNotes, planned: str) -> tuple[str, str] | None:
        """(kind, action) of an untrained off-plan move before `planned`, drawn at `detour_rate`."""
        if self.detour_rate <= 0 or self._detours_in[ep.id] >= self.max_detours:
            return None
        rng = detour_rng(self.seed, game_id(ep.traj.game), len(ep.traj.steps))
        if rng.random() >= self.detour_rate:
            return None
        last = next((s.arguments["action"] for s in reversed(ep.traj.steps)
                     if s.tool == EXECUTE_ACTION and not s.format_error and not s.error), "")
        return choose_detour(rng, seen_items(notes.room) or [], notes.checked, notes.location, last, planned)

    def _compress_reason(self, ep, notes: WorldNotes) -> str | None:
        """Why the expert compresses now, "milestone" or "context" (W past warn_ratio * T), or None when it
        does not. A milestone counts only MIN_STEPS_BETWEEN_COMPRESSIONS actions after the last compression."""
        last = ep.traj.steps[-1]
        milestone = self.milestone_compress and notes.milestone is not None
        if failed_compress(last):  # a rejected compression is answered with the correct one (sft/detours.py)
            return "milestone" if milestone else "context"  # its thoughts then say what was wrong
        if notes.env_since_compress < 1 or last.tool == READ:
            return None  # never twice without acting in between, nor between a read and the action it serves
        if milestone and notes.env_since_compress >= MIN_STEPS_BETWEEN_COMPRESSIONS:
            return "milestone"
        threshold = ep.memory.threshold * ep.memory.warn_ratio
        return "context" if ep.context.working_tokens > threshold else None

    def _compress_turn(self, ep, notes: WorldNotes, targets: Targets, action: str, budget: int,
                       reason: str) -> str | None:
        """The correct CompressExperience (after a rejected one: saying what was wrong; after a format
        error: the shortest), or, drawn at `rejected_compress_rate`, first one that the tool or the parser
        rejects (untrained); None if none fits."""
        last = ep.traj.steps[-1]
        call = self._compress(ep, notes, targets, action, budget, reason, shortest=last.format_error)
        if call is None:
            return None
        thoughts, arguments, text = call
        if failed_compress(last):
            return self._fit([recovery_thought(last.error or ""), ""], COMPRESS, arguments, budget) or text
        rng = detour_rng(self.seed, game_id(ep.traj.game), len(ep.traj.steps))
        if self.rejected_compress_rate > 0 and rng.random() < self.rejected_compress_rate:
            if rng.random() < 0.5:  # rejected by the tool
                broken = break_compress(rng, arguments, ep.context.anchor_source())
                wrong = broken and (broken[0], self._fit(thoughts, COMPRESS, broken[1], budget))
            else:  # rejected by the parser
                wrong = malform_call(rng, text)
            if wrong and wrong[1]:
                self.detours[wrong[0]] += 1
                self._untrained.add(ep.id)
                return wrong[1]
        return text

    def _compress(self, ep, notes: WorldNotes, targets: Targets, action: str, budget: int, reason: str,
                  shortest: bool = False):
        """(thoughts, arguments, text) of a CompressExperience, at the most detail that fits the token
        budget (None if none fits); at the least detail if `shortest`. `text` is the turn as `_fit` wrote it;
        its first thought gives `reason` (`_compress_reason`).

        When a name of the planned `action` would be in neither the summary nor a block afterwards
        (a small budget dropped its block), the summary says the next action exactly.
        """
        context_text = ep.context.anchor_source()
        anchored = evidence_blocks(notes, targets, context_text, per_class=self.seen_evidence == "anchor",
                                   end=self.anchor_end)
        working, threshold = ep.context.working_tokens, ep.memory.threshold
        if reason == "milestone":
            why = f"I {notes.milestone}: a good point to compress my context and archive the details."
        else:  # W triggered it
            why = f"My working context ({working} tokens) is near the threshold {threshold}; I compress it."
        existing = ep.store.indices()
        facts = {"db_index": FACTS_INDEX, "db_content": facts_text(notes, targets, full=True)}
        short = {"db_index": FACTS_INDEX, "db_content": facts_text(notes, targets, full=False)}
        # The most detail that fits the budget; the room overview is dropped last (later reads need it).
        # With seen_evidence "facts", where the objects are is in the short facts block at every level.
        if self.seen_evidence == "facts":  # where things are, without the summary's "Holding" line; no block
            where = facts_text(notes, targets, full=False, holding=False)  # when nothing was seen yet
            blocks = [*anchored, {"db_index": FACTS_INDEX, "db_content": where}] if where else anchored or [short]
            levels = ((2, blocks), (1, blocks), (0, blocks))
        else:
            levels = ((2, [*anchored, facts]), (1, [*anchored[:1], short]), (0, anchored[:1] or [short]))
        sought = sought_class(ep.traj.task_type, notes, targets)
        for detail, blocks in levels[::-1] if shortest else levels:
            indices = existing + [b["db_index"] for b in blocks if b["db_index"] not in existing]
            summary = summary_text(ep.traj.task_type, notes, targets, indices, detail)
            after = {i: ep.store.read(i).content for i in existing} | {
                b["db_index"]: block_content(b, context_text) for b in blocks}
            missing = [n for n in action_names(action) if not mentions(summary, n)]
            hint = block_for(after, missing, sought) if missing else None
            if hint is not None:  # the read that follows is named where the policy will look for it
                summary = summary.replace("\nIndex map:", f" Read {hint} first.\nIndex map:", 1)
            elif missing:  # in no block: the summary says the next action exactly
                summary = summary.replace("\nIndex map:", f" Next action: {action}.\nIndex map:", 1)
            thoughts = [why, "Time to compress."] if detail == 2 else ["Time to compress."]
            arguments = {"summary": summary, "db_blocks": blocks}
            text = self._fit(thoughts, COMPRESS, arguments, budget)
            if text is not None:
                return thoughts, arguments, text
        return None

    def _fit(self, thoughts: list[str], name: str, arguments: dict, budget: int) -> str | None:
        """Thought + one tool call, with the first thought (then none) that fits `budget` tokens."""
        for thought in [*thoughts, ""]:
            text = render_tool_call(name, arguments, thought)
            if len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 <= budget:
                return text
        if name != COMPRESS:  # an action must go out: the engine cuts it (a format error) rather than stall
            log.warning("a %s call does not fit in %d new tokens", name, budget)
            return render_tool_call(name, arguments)
        return None


def failed_compress(step) -> bool:
    """A CompressExperience that the tool rejected or that failed to parse (a format error)."""
    return step.tool == COMPRESS and bool(step.error) or step.format_error and COMPRESS in step.assistant


# --- texts ----------------------------------------------------------------------------------------
def index_for(text: str) -> str:
    """A valid experience index from free text (1-64 characters of [A-Za-z0-9_-])."""
    return (re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_") or "block")[:64]


def evidence_blocks(notes: WorldNotes, targets: Targets, context_text: str | list[str], per_class: bool = True,
                    end: str = "words") -> list[dict]:
    """Anchor-mode blocks for the exact evidence of this segment: the room overview (if `look` is in
    it), and (if `per_class`) for each target class the latest observation that shows one. `end`: anchor_block's."""
    blocks = []
    if notes.room_in_segment:
        blocks.append(anchor_block(ROOM_INDEX, notes.room, context_text, "Looking", end))
    for cls in targets.interesting() if per_class else []:
        seen = [body for _, body in notes.segment_obs if any(name_class(o) == cls for o in seen_items(body) or [])]
        if seen:
            mid = next(o for o in seen_items(seen[-1]) or [] if name_class(o) == cls)
            blocks.append(anchor_block(index_for(f"{cls}_seen"), seen[-1], context_text, mid, end))
    return [b for b in blocks if b is not None]


def anchor_block(index: str, body: str, context_text: str | list[str], mid: str, end_style: str = "words") -> dict | None:
    """An anchor-mode block that makes anchors.py copy exactly `body` from the context (checked here). Its end
    anchor (expert.anchor_end): the body's last words, or with "sentence" first "." (the nearest sentence end after
    the mid anchor: an ALFWorld observation's end, a constant the policy need not copy)."""
    words = body.split(" ")
    if mid not in body:
        mid = words[len(words) // 2]
    tries = [(n, ".") for n in (3, 5, 8, 12)] if end_style == "sentence" else []  # shortest start first
    tries += [(n_start, " ".join(words[-n_end:]))
              for n_start, n_end in ((3, 2), (5, 3), (8, 5), (12, 8), (len(words), len(words)))]
    for n_start, end in tries:
        start = " ".join(words[:n_start])
        if extract_span(context_text, start, mid, end) == body:
            return {"db_index": index, "start_anchor": start, "mid_anchor": mid, "end_anchor": end}
    log.debug("no anchors copy %r exactly; block %s skipped", body[:60], index)
    return None


def block_for(contents: dict[str, str], names: list[str], sought: str = "") -> str | None:
    """The block (index -> content) to read for an action that needs `names`: the one that names all (else
    most) of them; among those, one that also names the `sought` class (where the object was seen, not just
    the receptacle's name: what justifies going there), then the room overview, then the smallest."""
    best: tuple[int, bool, bool, int, str] | None = None
    for index, content in contents.items():
        hits = sum(mentions(content, n) for n in names)
        rank = (-hits, not (sought and mentions(content, sought)), index != ROOM_INDEX, len(content), index)
        if hits and (best is None or rank < best):
            best = rank
    return best[-1] if best else None


def sought_class(task_type: str, notes: WorldNotes, targets: Targets) -> str:
    """The class the agent is after now: the object until it is held, then the lamp, the appliance or the
    target receptacle (next_goal's order)."""
    if not notes.held:
        return targets.obj
    if task_type == "look_at_obj_in_light":
        return targets.toggle
    need = NEEDS.get(task_type)
    if need and TRANSFORMS[need] not in notes.states.get(notes.held, []):
        return APPLIANCE[need]
    return targets.parent


def block_content(block: dict, context_text: str | list[str]) -> str:
    """What a db_block will store: its db_content, or the span its anchors copy from the context."""
    if "db_content" in block:
        return block["db_content"]
    return extract_span(context_text, block["start_anchor"], block["mid_anchor"], block["end_anchor"]) or ""


def summary_text(task_type: str, notes: WorldNotes, targets: Targets, indices: list[str], detail: int = 2) -> str:
    """Progress, next step and the index map: one line per index, saying what it holds (memex.md). While
    the sought object is not yet seen, the receptacles already checked (so that the search goes on, not over).

    Exact IDs beyond the held object and the current place stay in the store (the facts block lists what was checked),
    so that acting on them later means reading them back. Less `detail` (to fit a small generation
    budget) shortens progress and the index descriptions; every index is always listed.
    """
    state = f"Holding: {held_text(notes)}." + (f" At: {notes.location}." if notes.location else "")
    sought = sought_class(task_type, notes, targets)
    if sought in targets.interesting() and not notes.where_seen(sought) and notes.checked:
        state += f" Checked: {', '.join(notes.checked)}."  # still searching: where not to look again
    if detail >= 2:
        lines = [f"Progress: {'; '.join(notes.done) or 'searching'}. {state}"]
    else:
        lines = [state + "".join(f" Placed {o} in/on {r}." for o, r in notes.placed)]
    lines.append(f"Next: {next_goal(task_type, notes, targets)}.")
    lines.append("Index map:")
    lines.extend(f"- {i}: {describe_index(i, short=detail < 2)}" for i in indices)
    return "\n".join(lines)


def with_article(noun: str) -> str:
    """'a mug', 'an apple'."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def held_text(notes: WorldNotes) -> str:
    """'apple 1 (heated)', or 'nothing'."""
    states = notes.states.get(notes.held or "")
    return f"{notes.held} ({', '.join(states)})" if notes.held and states else notes.held or "nothing"


def describe_index(index: str, short: bool = False) -> str:
    """What a block of the expert's holds, for the index map."""
    if index == ROOM_INDEX:
        return "receptacle names" if short else "room overview from look (all receptacle names)"
    if index == FACTS_INDEX:
        return "exact IDs" if short else "exact IDs: what I hold, where the targets are, what I checked"
    if index.endswith("_seen"):
        what = index.removesuffix("_seen")
        return f"where the {what} is" if short else f"observation where I saw {with_article(what)}"
    return "archived notes"


def facts_text(notes: WorldNotes, targets: Targets, full: bool, holding: bool = True) -> str:
    """Derived facts with exact IDs (explicit mode); without the `holding` line, '' when nothing else is known."""
    lines = [f"holding: {held_text(notes)}"] if holding else []
    for cls in targets.interesting():
        where = notes.where_seen(cls)
        if where:
            lines.append(f"{cls} seen: " + ", ".join(f"{o} in/on {r}" for o, r in where[: 4 if full else 1]))
    lines.extend(f"placed: {o} in/on {r}" for o, r in notes.placed)
    if full and notes.checked:
        lines.append("checked: " + ", ".join(notes.checked))
    return "\n".join(lines)


def next_goal(task_type: str, notes: WorldNotes, targets: Targets) -> str:
    """The next subgoal in words, from the task type and what is done."""
    obj, parent = targets.obj or "target", targets.parent or "its place"
    if task_type == "look_at_obj_in_light":
        return f"find {with_article(obj)}" if not notes.held else f"find the {targets.toggle or 'lamp'} and turn it on"
    if not notes.held:
        second = task_type == "pick_two_obj_and_place" and notes.placed
        return "find " + with_article(f"second {obj}" if second else obj)
    need = NEEDS.get(task_type)
    if need and TRANSFORMS[need] not in notes.states.get(notes.held, []):
        return f"{need} {notes.held} with the {APPLIANCE[need]}"
    return f"put {notes.held} in/on the {parent}"


def act_thought(action: str, notes: WorldNotes, targets: Targets) -> str:
    """One sentence saying why the next env action."""
    verb, names = action.split(" ", 1)[0], action_names(action)
    obj = targets.obj or "target"
    if verb == "go" and names:
        place = names[0]
        if notes.held:
            return f"I have the {notes.held}; next I go to {place}."
        if any(name_class(o) == obj for o in notes.contents.get(place, [])):
            return f"I saw {with_article(obj)} at {place}; I go back there."
        return f"I am looking for {with_article(obj)}; let me check {place}."
    if verb == "open" and names:
        return f"{names[0]} is closed; I open it to look inside."
    if verb == "close" and names:
        return f"Nothing I need in {names[0]}; I close it."
    if verb == "take" and len(names) == 2:
        return f"There is {names[0]} at {names[1]}; I take it."
    if verb == "move" and len(names) == 2:
        return f"I put the {names[0]} in/on {names[1]}."
    if verb in TRANSFORMS and len(names) == 2:
        return f"I {verb} the {names[0]} with {names[1]}."
    if verb == "use" and names:
        return f"I turn on {names[0]} to look at the {notes.held or obj} under its light."
    if verb == "examine" and names:
        return f"I examine {names[0]} to see what is there."
    return f"Next I do: {action}."
