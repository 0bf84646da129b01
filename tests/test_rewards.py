"""The reward and its three penalties against hand-computed values (memex.md "Reward")."""

import pytest

from common.config import RewardConfig
from common.trajectory import Step, Trajectory
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
