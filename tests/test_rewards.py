"""The reward and its three penalties against hand-computed values (memex.md "Reward")."""

import pytest

from common.config import RewardConfig, load_config
from common.trajectory import READING_TASK, Step, Trajectory
from rewards import context_penalty, format_penalty, mark_redundant, redundancy_penalty, score_trajectory


def act(action, state_changing=False, **kw):
    return Step(
        assistant="", tool="execute_action", arguments={"action": action}, format_error=False, error=None,
        observation="", working_tokens=kw.get("w", 0), state_changing=state_changing,
    )


def mem(tool="ReadExperience", **kw):
    return Step(assistant="", tool=tool, arguments={"db_index": "a"}, format_error=False, error=None,
                observation="", working_tokens=kw.get("w", 0), compressed=kw.get("compressed", False))


def bad():
    return Step(assistant="", tool=None, arguments=None, format_error=True, error="x", observation="", working_tokens=0)


def nocall():
    return Step(assistant="", tool=None, arguments=None, format_error=False, error=None, observation="", working_tokens=0)


def test_context_penalty_hand_computed():
    # T = 100, C = [50, 150, 300 (compressed: skipped), 120], 4 steps: (50 + 20) / (100 * 4) = 0.175
    assert context_penalty([50, 150, 300, 120], [False, False, True, False], 100, 1.0) == pytest.approx(0.175)
    assert context_penalty([50, 150, 300, 120], [False, False, True, False], 100, weight=2.0) == pytest.approx(0.35)
    assert context_penalty([10_000], [False], 100, 1.0) == 1.0  # capped at 1
    assert context_penalty([], [], 100, 1.0) == 0.0


def test_redundancy_window_resets_at_state_change():
    steps = [
        act("go to fridge 1"),
        act("go to fridge 1"),                       # redundant
        mem(),                                       # memory tools never count
        act("open fridge 1", state_changing=True),   # new window = {open fridge 1}
        act("go to fridge 1"),                       # not redundant: the state changed since
        act("open fridge 1", state_changing=True),   # redundant: same call, nothing changed since
        act("examine fridge 1"),
    ]
    assert mark_redundant(steps) == [False, True, False, False, False, True, False]
    # 2 redundant of 6 non-memory calls, weight 0.05
    assert redundancy_penalty(steps, 0.05) == pytest.approx(0.05 * 2 / 6)


def test_format_penalty_counts_attempted_calls_only():
    steps = [bad(), nocall(), act("look"), mem(), bad()]
    # 2 malformed of 4 attempts (the reply without a call is not an attempt)
    assert format_penalty(steps, 1.0) == pytest.approx(0.5)
    assert format_penalty([nocall()], 1.0) == 0.0


def test_score_trajectory_composes_total():
    traj = Trajectory(game="g", task_type="t", goal="x", success=True)
    traj.steps = [act("look", w=50), act("look", w=150), bad()]
    reward = score_trajectory(traj, 100, RewardConfig())  # the paper's weights: 1, 0.05, 1
    assert reward["task"] == 1.0
    assert reward["context"] == pytest.approx(50 / 300)
    assert reward["redundancy"] == pytest.approx(0.05 * 1 / 2)
    assert reward["format"] == pytest.approx(1 / 3)
    assert reward["total"] == pytest.approx(1 - 50 / 300 - 0.025 - 1 / 3)
    assert [s.redundant for s in traj.steps] == [False, True, False]


def reading_episode(reads: int) -> Trajectory:
    """Two pages (C 50, 150), the question (C 120), `reads` reads of a 50-token block each, finish; T = 100. The
    first block holds the one planted string, so every episode scores R_task 1."""
    traj = Trajectory(game="g", task_type="reading/static", goal="x",
                      task={"kind": READING_TASK, "evidence": ["EUR"], "max_reads": 3, "question_step": 2},
                      experience={"b0": "price in EUR", "b1": "other", "b2": "more"})
    traj.steps = [act("next", w=50), act("next", w=150), act("next", w=120)]
    traj.steps += [mem(w=120 + 50 * (n + 1)) for n in range(reads)]
    for n, step in enumerate(traj.steps[3:]):
        step.arguments = {"db_index": f"b{n}"}
    traj.steps.append(Step(assistant="", tool="finish", arguments={}, format_error=False, error=None,
                           observation="", working_tokens=traj.steps[-1].working_tokens))
    return traj


def test_the_question_phase_is_charged_unless_the_switch_says_otherwise():
    """memex.md's P_context charges every read after the question, so of two episodes with the same R_task the one
    that read less scores higher; with reward.charge_question_phase false the read budget costs nothing."""
    paper, ours = RewardConfig(), load_config(None, ["reward.charge_question_phase=false"]).reward
    one, three = reading_episode(1), reading_episode(3)
    # paper: the second page 50 over T, the question 20, the read 70 and finish 70 over 5 steps; three reads: 70,
    # 120, 170 and finish 170 over 7 steps
    assert score_trajectory(one, 100, paper)["context"] == pytest.approx((50 + 20 + 70 + 70) / 500)
    assert score_trajectory(three, 100, paper)["context"] == pytest.approx((50 + 20 + 70 + 120 + 170 + 170) / 700)
    assert one.reward["task"] == three.reward["task"] == 1.0 and one.reward["total"] > three.reward["total"]
    for traj in (one, three):  # only the second page's 50 over T is charged; the denominator keeps every step
        assert score_trajectory(traj, 100, ours)["context"] == pytest.approx(50 / (100 * len(traj.steps)))
    never_asked = reading_episode(1)
    never_asked.task.pop("question_step")  # never got to the question: every step is charged
    assert score_trajectory(never_asked, 100, ours)["context"] == score_trajectory(reading_episode(1), 100, paper)[
        "context"]
    alfworld = Trajectory(game="g", task_type="t", goal="x", task={"question_step": 0})
    alfworld.steps = [act("look", w=150)]  # not a reading episode: the switch changes nothing
    assert score_trajectory(alfworld, 100, ours)["context"] == pytest.approx(0.5)
