"""Kept rollouts (training/pending.py): what a run stopped before its update resumes from, or sets aside."""

from __future__ import annotations

import json
import logging

from common.trajectory import Segment, Step, Trajectory
from training.pending import PlayedStep, discard_played_steps, keep_played_step, load_played_step, step_dir


def played() -> PlayedStep:
    step = Step("<think>x</think>", "CompressExperience", {"summary": "s"}, False, None, "ok", 812, compressed=True,
                state_changing=True)
    segment = Segment(0, [1, 2, 3], [4, 5, 6], [1, 1, 0], [-0.25, -1.5e-7, 0.0], last_step=0,
                      messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "task é"}])
    traj = Trajectory("s1/task-03", "reading", "answer", success=True, reward={"R": 0.75, "task": 1.0},
                      steps=[step], segments=[segment, Segment(1, [7], [8], [1], [-0.1])],
                      experience={"pages-1": "Home > Sales"}, end_reason="finish", task={"kind": "reading", "evidence": ["a"]})
    return PlayedStep([traj, Trajectory("g", "t", "goal", end_reason="crash", error="worker died")], [0, 0],
                      {"step": 3, "rollout_s": 12.5, "num_crashed": 1}, {"epoch": 0, "position": 2, "num_games": 9})


def test_kept_rollouts_load_as_they_were_played(tmp_path):
    original = played()
    keep_played_step(tmp_path, 3, 0, 1, original)
    loaded = load_played_step(tmp_path, 3, 0, 1)
    assert loaded == original  # every field, the token ids, masks and log-probs exactly
    assert loaded.trajectories[0].steps[0].state_changing and loaded.trajectories[1].crashed


def test_rollouts_that_do_not_fit_the_resume_are_set_aside(tmp_path, caplog):
    keep_played_step(tmp_path, 3, 0, 2, played())
    with caplog.at_level(logging.WARNING):
        assert load_played_step(tmp_path, 3, 0, 1) is None  # played by 2 processes, resumed with 1
        assert load_played_step(tmp_path, 3, 1, 2) is None  # the other process's file is missing
    assert "played by 2 processes" in caplog.text and "rank-1.json" in caplog.text
    path = step_dir(tmp_path, 3) / "rank-0.json"
    path.write_text(path.read_text()[:-40])  # cut short
    assert load_played_step(tmp_path, 3, 0, 2) is None and "does not load" in caplog.text
    record = played()
    record.groups = [0]
    keep_played_step(tmp_path, 4, 0, 1, record)
    assert load_played_step(tmp_path, 4, 0, 1) is None
    assert load_played_step(tmp_path, 5, 0, 1) is None  # none kept: no warning
    assert "step 5" not in caplog.text


def test_a_checkpoint_discards_the_rollouts_it_trained_on(tmp_path):
    for step in (2, 3):
        keep_played_step(tmp_path, step, 0, 1, played())
    discard_played_steps(tmp_path, 2)
    assert not step_dir(tmp_path, 2).exists() and step_dir(tmp_path, 3).is_dir()
    assert json.loads((step_dir(tmp_path, 3) / "rank-0.json").read_text())["step"] == 3
