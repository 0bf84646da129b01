"""The Memex expert's untrained detours (sft/detours.py): off-plan moves that are played, never learned."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from common.config import load_config  # noqa: E402
from envs.data import ordered_games  # noqa: E402
from memexrl.cli import replay  # noqa: E402
from memory.context import WorkingContext  # noqa: E402
from memory.parsing import COMPRESS, parse_tool_call, render_tool_call  # noqa: E402
from memory.store import open_store  # noqa: E402
from memory.tools import run_compress  # noqa: E402
from sft import detours  # noqa: E402
from sft.demos import run_expert  # noqa: E402
from sft.expert import failed_compress  # noqa: E402

ROOM = ["cabinet 1", "cabinet 2", "countertop 1", "fridge 1", "sinkbasin 1"]


def test_a_detour_is_never_the_planned_action():
    for seed in range(200):
        rng = random.Random(seed)
        planned = rng.choice([f"go to {r}" for r in ROOM] + ["open fridge 1"])
        got = detours.choose_detour(rng, ROOM, ["cabinet 1", "fridge 1"], "fridge 1", "open fridge 1", planned)
        assert got is not None
        kind, action = got
        assert kind in detours.DETOUR_KINDS and action != planned
        if kind == "wander":
            assert action.removeprefix("go to ") in {"cabinet 2", "countertop 1", "sinkbasin 1"}
        elif kind == "revisit":
            assert action == "go to cabinet 1"  # checked, and not where the agent stands
        else:
            assert action == "open fridge 1"


def test_no_detour_when_nothing_applies():
    rng = random.Random(0)
    # Only one receptacle, the agent is there, and its last action (go to) is not safe to repeat.
    assert detours.choose_detour(rng, ["fridge 1"], ["fridge 1"], "fridge 1", "go to fridge 1", "open fridge 1") is None
    # The only option is the plan itself.
    assert detours.choose_detour(rng, ["fridge 1", "cabinet 1"], [], "fridge 1", "look", "go to cabinet 1") is None


def test_detours_are_deterministic_per_game_and_step():
    a = [detours.detour_rng(0, "train/x/trial_1", 5).random() for _ in range(2)]
    assert a[0] == a[1]
    assert detours.detour_rng(0, "train/x/trial_1", 6).random() != a[0]
    assert detours.detour_rng(1, "train/x/trial_1", 5).random() != a[0]
    assert "cabinet 2" in detours.detour_thought("wander", "go to cabinet 2")


LOOK = ("You are in the middle of a room. Looking quickly around you, you see a shelf 3, a shelf 2, "
        "a drawer 1, and a shelf 1.")
GOOD = {"summary": "Next: find a mug.\nIndex map:\n- room: room overview\n- facts: exact IDs",
        "db_blocks": [{"db_index": "room", "start_anchor": "You are in", "mid_anchor": "Looking",
                       "end_anchor": "shelf 1."}, {"db_index": "facts", "db_content": "holding: nothing"}]}


def compress_with(arguments, smol_tokenizer, scope="context", before=()):
    """Run CompressExperience for real on a context holding the look output (then the assistant turns
    `before`, each answered by an observation): (outcome, store)."""
    from rollout.runner import make_renderer

    ctx = WorkingContext(make_renderer(smol_tokenizer, load_config(None, [])), "system", "find a mug.", threshold=1000,
                         warn_ratio=0.8, anchor_scope=scope)
    ctx.add_observation(LOOK, [])
    for n, turn in enumerate(before, start=2):
        ctx.add_assistant(turn, [1], [0.0], step=n)
        ctx.add_observation("CompressExperience error: anchors not found.", [])
    ctx.add_assistant("Time to compress.", [1], [0.0], step=1)
    store = open_store("memory")
    return run_compress(arguments, ctx, store, step=1, summary_max_tokens=300), store


def test_a_rejected_anchor_block_says_which_anchor_to_copy_again(smol_tokenizer):
    """The agent's fix depends on why no span was found: an anchor it did not copy exactly (named, with its
    text), or anchors that each occur but in no one observation together (memory.anchor_scope observations)."""
    typo = {"summary": "s", "db_blocks": [{"db_index": "room", "start_anchor": "You are in",
                                           "mid_anchor": "Looking", "end_anchor": "shelf 9."}]}
    outcome, store = compress_with(typo, smol_tokenizer, "observations")
    assert not outcome.compressed and len(store) == 0
    assert "end_anchor 'shelf 9.' occurs nowhere" in outcome.error and "start_anchor '" not in outcome.error
    # the guessed end anchor is the usual mistake: the error says how the overview's line really ends
    assert outcome.error.endswith("that line ends with 'a shelf 1.')")
    split = {"summary": "s", "db_blocks": [{"db_index": "room", "start_anchor": "You are in",
                                            "mid_anchor": "Looking", "end_anchor": "error: anchors"}]}
    outcome, _ = compress_with(split, smol_tokenizer, "observations", before=["x"])  # end only in the 2nd observation
    assert not outcome.compressed and "each anchor occurs" in outcome.error and "one observation" in outcome.error
    assert "that line ends with 'a shelf 1.'" in outcome.error
    fixed = {"summary": "s", "db_blocks": [dict(split["db_blocks"][0], end_anchor="a shelf 1.")]}
    outcome, store = compress_with(fixed, smol_tokenizer, "observations", before=["x"])  # the retry the hint asks for
    assert outcome.compressed and store.read("room").content.endswith("and a shelf 1.")


def test_a_rejected_anchor_call_retried_unchanged_matches_its_own_text_only_in_scope_context(smol_tokenizer):
    """memory.anchor_scope: the anchors of a rejected call stay in the context as the agent's own text; in
    scope "context" (memex.md) the unchanged retry copies that text, in "observations" it is rejected again."""

    wrong = {"summary": "s", "db_blocks": [{"db_index": "room", "start_anchor": "You are in",
                                            "mid_anchor": "mug 7", "end_anchor": "sofa 9."}]}
    rejected = f'<tool_call>{{"name": "CompressExperience", "arguments": {json.dumps(wrong)}}}</tool_call>'
    outcome, _ = compress_with(wrong, smol_tokenizer)
    assert not outcome.compressed and "anchors not found" in outcome.error
    outcome, store = compress_with(wrong, smol_tokenizer, "context", before=[rejected])
    assert outcome.compressed and '"mid_anchor": "mug 7"' in store.read("room").content
    outcome, store = compress_with(wrong, smol_tokenizer, "observations", before=[rejected])
    assert not outcome.compressed and "anchors not found" in outcome.error and len(store) == 0
    outcome, store = compress_with(GOOD, smol_tokenizer, "observations", before=[rejected])  # the right anchors
    assert outcome.compressed and store.read("room").content == LOOK


def test_a_broken_compression_is_rejected_by_the_real_tool_and_the_correct_one_is_not(smol_tokenizer):
    seen = set()
    for seed in range(40):
        kind, broken = detours.break_compress(random.Random(seed), GOOD, LOOK)
        seen.add(kind)
        outcome, store = compress_with(broken, smol_tokenizer)
        assert outcome.error and not outcome.compressed and len(store) == 0, (kind, broken)
        assert detours.recovery_thought(outcome.error) != detours.recovery_thought("something else")  # names the mistake
    assert seen == set(detours.BROKEN_COMPRESS_KINDS)
    assert GOOD["db_blocks"][0]["end_anchor"] == "shelf 1." and len(GOOD["db_blocks"]) == 2  # not changed
    outcome, store = compress_with(GOOD, smol_tokenizer)
    assert outcome.compressed and store.read("room").content == LOOK
    # Nothing to break: no blocks at all.
    assert detours.break_compress(random.Random(0), {"summary": "s", "db_blocks": []}, LOOK) is None


def test_a_malformed_compression_is_a_format_error_and_its_answer_is_shorter(smol_tokenizer):
    text = render_tool_call(COMPRESS, GOOD, "Time to compress.")
    seen = set()
    for seed in range(30):
        kind, bad = detours.malform_call(random.Random(seed), text)
        seen.add(kind)
        parsed = parse_tool_call(bad)
        assert parsed.format_error and bad != text, (kind, bad)
        assert ("unclosed" in parsed.error) == (kind == "cut")
        assert detours.recovery_thought(parsed.error) not in (detours.recovery_thought("anchors not found"), detours.recovery_thought("x"))
    assert seen == set(detours.MALFORMED_CALL_KINDS)
    # A brace inside a string is never the one left out: the result must still fail to parse.
    braces = render_tool_call(COMPRESS, {"summary": "}}}", "db_blocks": []}, "x")
    for seed in range(10):
        assert parse_tool_call(detours.malform_call(random.Random(seed), braces)[1]).format_error
    assert detours.malform_call(random.Random(0), "no call here") is None


# ----------------------------------------------------------------------------- real games
@pytest.fixture(scope="module")
def detoured(alfworld_data, smol_tokenizer):
    """The expert with many detours on 6 valid_seen games of mixed task types: (cfg, trajectories, engine)."""
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=1000", "expert.detour_rate=0.4",
                             "expert.rejected_compress_rate=0.5"])
    games = ordered_games("valid_seen", alfworld_data, "mixed")[:6]
    trajs, engine = run_expert(cfg, games, smol_tokenizer, workers=2)
    return cfg, trajs, engine


def is_detour(step) -> bool:
    if failed_compress(step):  # a rejected or malformed compression: untrained too
        return True
    action = (step.arguments or {}).get("action", "")
    return any(step.assistant.startswith(detours.detour_thought(kind, action)) for kind in detours.DETOUR_KINDS)


def trained_texts(traj, tokenizer) -> list[str]:
    """The decoded runs of loss-mask-1 tokens of a trajectory's segments, in order."""
    texts = []
    for seg in traj.segments:
        run: list[int] = []
        for tok, m in zip(seg.completion_ids + [None], seg.loss_mask + [0]):
            if m:
                run.append(tok)
            elif run:
                texts.append(tokenizer.decode(run, skip_special_tokens=True).strip())
                run = []
    return texts


@pytest.mark.slow
def test_detour_turns_are_played_but_not_trained(detoured, smol_tokenizer):
    _, trajs, engine = detoured
    detours = [s for t in trajs for s in t.steps if is_detour(s)]
    assert len(detours) == sum(engine.detours.values()) > 0
    for t in trajs:
        # Exactly the non-detour turns carry loss mask 1, token for token.
        assert trained_texts(t, smol_tokenizer) == [s.assistant.strip() for s in t.steps if not is_detour(s)]


@pytest.mark.slow
def test_demos_with_detours_still_win_and_replay(detoured, smol_tokenizer):
    cfg, trajs, _ = detoured
    won = [t for t in trajs if t.success]
    assert len(won) >= 4
    assert any(any(is_detour(s) for s in t.steps) for t in won)
    for t in won:  # the only format errors are the untrained malformed compressions
        assert all(not s.format_error or is_detour(s) for s in t.steps)
        out = replay(t.game, [s.assistant for s in t.steps], cfg, smol_tokenizer)
        assert out["success"] is True and out["experience"] == t.experience


@pytest.mark.slow
def test_detours_lead_to_compressions_under_the_warning(detoured):
    """The point of the detours: demonstrations where the expert compresses once W passed 0.8 T."""
    cfg, trajs, _ = detoured
    warn = cfg.memory.warn_ratio * cfg.memory.threshold
    under_warning = [
        t.steps[i]
        for t in trajs
        for i in range(1, len(t.steps))
        if t.steps[i].tool == COMPRESS and t.steps[i - 1].working_tokens > warn
    ]
    trained = [s for s in under_warning if not is_detour(s)]  # rejected ones are answered (test below)
    assert trained and all(s.compressed for s in trained)


@pytest.mark.slow
def test_each_rejected_compression_is_answered_by_a_trained_correct_one(detoured):
    _, trajs, engine = detoured
    rejected = [(t, i) for t in trajs for i, s in enumerate(t.steps) if failed_compress(s)]
    assert len(rejected) == sum(engine.detours[k] for k in detours.BROKEN_COMPRESS_KINDS + detours.MALFORMED_CALL_KINDS)
    assert sum(engine.detours[k] for k in detours.BROKEN_COMPRESS_KINDS) > 0
    assert sum(engine.detours[k] for k in detours.MALFORMED_CALL_KINDS) > 0
    for t, i in rejected:
        answer = t.steps[i + 1]
        assert answer.tool == COMPRESS and answer.compressed and answer.error is None
        assert answer.assistant.startswith(detours.recovery_thought(t.steps[i].error)) or "rejected" not in answer.assistant
        failed = t.steps[i].assistant
        if t.steps[i].format_error and failed.endswith("</tool_call>"):  # unmatched brackets, not cut
            call = answer.assistant[answer.assistant.index("<tool_call>"):]
            assert len(call) <= len(failed[failed.index("<tool_call>"):]) + 1  # the shortest call, never longer
