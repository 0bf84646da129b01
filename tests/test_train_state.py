"""Task sampler and checkpoint files of a GRPO run (training/state.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from common.errors import MemexError
from training.state import (
    MANIFEST_FILE,
    STATE_FILE,
    MixedSampler,
    TaskSampler,
    checkpoint_problem,
    clear_run,
    find_checkpoint,
    load_checkpoint,
    newest_checkpoint,
    previous_run,
    refuse_to_mix,
    save_checkpoint,
    task_pool,
    trim_metrics,
)


def test_sampler_is_a_seeded_permutation_per_epoch_and_resumes():
    games = [f"g{i}" for i in range(5)]
    a = TaskSampler(games, seed=1)
    first_epoch = a.next(5)
    assert sorted(first_epoch) == games  # every game once per epoch
    second = a.next(3)
    b = TaskSampler(games, seed=1)
    b.next(5)
    state = b.state_dict()
    c = TaskSampler(games, seed=1)
    c.load_state_dict(state)
    assert c.next(3) == second == b.next(3)
    assert TaskSampler(games, seed=2).next(5) != first_epoch
    with pytest.raises(MemexError, match="same train.split"):
        TaskSampler(games[:4], seed=1).load_state_dict(state)
    with pytest.raises(MemexError, match="no games"):
        TaskSampler([], seed=1)


def test_a_mixed_schedule_holds_the_reading_share_of_every_step_and_resumes():
    alfworld, reading = [f"a{i}" for i in range(7)], [f"r{i}.json" for i in range(5)]

    def mixed():
        return MixedSampler(TaskSampler(alfworld, seed=0), TaskSampler(reading, seed=1), share=0.25)

    run = mixed()
    steps = [run.next(4) for _ in range(6)]
    assert all(sum(g.endswith(".json") for g in step) == 1 for step in steps)  # 1 of 4, every step
    drawn_reading = [g for step in steps for g in step if g.endswith(".json")]
    assert sorted(drawn_reading[:5]) == reading  # each pool goes through its own epochs
    resumed = mixed()
    head = mixed()
    for _ in range(3):
        head.next(4)
    resumed.load_state_dict(json.loads(json.dumps(head.state_dict())))
    assert [resumed.next(4) for _ in range(3)] == steps[3:]
    with pytest.raises(MemexError, match="reading_share"):
        MixedSampler(TaskSampler(alfworld, 0), TaskSampler(reading, 1), 0.5).load_state_dict(head.state_dict())
    with pytest.raises(MemexError, match="reading_share"):
        mixed().load_state_dict(TaskSampler(alfworld, 0).state_dict())  # a run started without reading tasks


def _optimizer():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    sched.step()
    return opt, sched


def test_task_pool_takes_the_first_games_in_the_chosen_order(alfworld_data):
    from envs.data import task_type_of

    sorted_pool = task_pool("train", 6, "sorted", alfworld_data)
    mixed_pool = task_pool("train", 6, "mixed", alfworld_data)
    assert len({task_type_of(g) for g in sorted_pool}) == 1  # the sorted split starts with one task type
    assert len({task_type_of(g) for g in mixed_pool}) == 6  # mixed: the six types in turn (the expert's games)
    everything = task_pool("train", 0, "mixed", alfworld_data)  # 0: the whole split
    assert len(everything) == 3553 and everything[:6] == mixed_pool
    assert sorted(everything) == task_pool("train", 0, "sorted", alfworld_data)
    with pytest.raises(MemexError, match="unknown game order 'shuffled'"):
        task_pool("train", 6, "shuffled", alfworld_data)


def test_task_pool_of_chosen_task_types_keeps_the_demonstrated_games(alfworld_data):
    """train.task_types: a curriculum of two types is, in mixed order, those types' games among the first
    games of the split (the ones `memexrl expert --games N` demonstrated), in the same order."""
    from envs.data import task_type_of

    types = "pick_and_place_simple,look_at_obj_in_light"
    pool = task_pool("train", 8, "mixed", alfworld_data, types)
    assert [task_type_of(g) for g in pool] == ["look_at_obj_in_light", "pick_and_place_simple"] * 4
    first_twelve = task_pool("train", 12, "mixed", alfworld_data)  # two of each of the six types
    assert pool[:4] == [g for g in first_twelve if task_type_of(g) in types.split(",")]
    with pytest.raises(MemexError, match="unknown ALFWorld task type.*pick_and_boil"):
        task_pool("train", 8, "mixed", alfworld_data, "pick_and_boil")


def test_a_games_file_names_the_pool_wherever_the_data_lies(alfworld_data, tmp_path):
    """train.games_file / eval.games_file: paths relative to the data root (what `memexrl expert` writes, so
    the file works wherever ALFWORLD_DATA points), absolute paths and SPLIT:INDEX, in the file's order,
    comments and blank lines skipped; num_games takes the first N; a line naming no game, an empty file or a
    binary one stops with one message naming the file (and the line)."""
    from envs.data import game_spec, list_games, read_games_file

    valid = list_games("valid_seen", alfworld_data)
    relative = game_spec(valid[3], alfworld_data)
    assert not relative.startswith("/") and relative.startswith("json_2.1.1/valid_seen/")
    games = tmp_path / "games.txt"
    games.write_text(f"# memory games\n{relative}\n\n{valid[0]}  # absolute\nvalid_seen:5\n")
    assert read_games_file(games, alfworld_data) == [valid[3], valid[0], valid[5]]
    assert task_pool("train", 2, "sorted", alfworld_data, "", str(games)) == [str(valid[3]), str(valid[0])]
    assert task_pool("train", 0, "sorted", alfworld_data, "", str(games)) == [str(g) for g in (valid[3], valid[0], valid[5])]
    games.write_text(f"{relative}\njson_2.1.1/valid_seen/no-such-game\n")
    with pytest.raises(MemexError, match=r"games.txt line 2: no ALFWorld game"):
        read_games_file(games, alfworld_data)
    games.write_text("# nothing\n\n")
    with pytest.raises(MemexError, match="lists no game"):
        read_games_file(games, alfworld_data)
    games.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(MemexError, match="cannot read the games file"):
        read_games_file(games, alfworld_data)
    with pytest.raises(MemexError, match="cannot read the games file"):
        read_games_file(tmp_path / "missing.txt", alfworld_data)


def test_checkpoint_round_trip_restores_optimizer_scheduler_and_rng(tmp_path):
    opt, sched = _optimizer()
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 3, lambda d: (d / "weights.txt").write_text("w"), opt, sched, {"sampler": {}})
    assert path == tmp_path / "checkpoints" / "step-3"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the temp dir was renamed
    expected = (random.random(), np.random.rand(), torch.rand(1))
    opt2, sched2 = _optimizer()
    opt2.state_dict()["state"][0]["exp_avg"].zero_()
    state = load_checkpoint(path, opt2, sched2)
    assert state["step"] == 3
    torch.testing.assert_close(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_find_checkpoint_and_errors(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    with pytest.raises(MemexError, match="no checkpoint"):
        find_checkpoint(tmp_path, "latest")
    opt, sched = _optimizer()
    for step in (2, 10):
        save_checkpoint(tmp_path, step, lambda d: None, opt, sched, {})
    (tmp_path / "checkpoints" / "step-11").mkdir()  # half-written by hand: no trainer_state.json
    assert find_checkpoint(tmp_path, "latest").name == "step-10"
    with pytest.raises(MemexError, match="not a GRPO checkpoint"):
        find_checkpoint(tmp_path, str(tmp_path / "checkpoints" / "step-11"))
    (tmp_path / "checkpoints" / "step-10" / "optimizer.pt").write_bytes(b"garbage")
    with pytest.raises(MemexError, match="incomplete or unreadable"):
        load_checkpoint(tmp_path / "checkpoints" / "step-10", opt, sched)


def test_trim_metrics_drops_steps_past_the_checkpoint(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(f'{{"step": {s}, "loss": 0}}\n' for s in (1, 2, 3, 4)))
    trim_metrics(f, 2)
    assert f.read_text().splitlines() == ['{"step": 1, "loss": 0}', '{"step": 2, "loss": 0}']


def test_a_torn_last_metrics_line_is_dropped_and_a_bad_middle_line_named(tmp_path, caplog):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1, "loss": 0}\n{"step": 2, "loss": 0}\n{"step": 3, "lo')  # the crash came mid-write
    trim_metrics(f, 5)
    assert f.read_text().splitlines() == ['{"step": 1, "loss": 0}', '{"step": 2, "loss": 0}']
    assert "torn last line 3" in caplog.text
    f.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MemexError, match=r"metrics.jsonl:2 is not a metrics record"):
        trim_metrics(f, 5)
    assert f.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'  # left as it was


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_why(tmp_path, caplog):
    opt, sched = _optimizer()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, lambda d: (d / "adapter_model.safetensors").write_bytes(b"w" * 1000),
                        opt, sched, {})
    newest = tmp_path / "checkpoints" / "step-2"
    manifest = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    assert {"adapter_model.safetensors", "optimizer.pt", STATE_FILE} <= manifest.keys()
    assert checkpoint_problem(newest) is None
    with open(newest / "adapter_model.safetensors", "r+b") as f:  # a disk that cut the adapter
        f.truncate(400)
    assert "adapter_model.safetensors has 400 bytes" in checkpoint_problem(newest)
    assert find_checkpoint(tmp_path, "latest").name == "step-1"
    assert "skipping checkpoint" in caplog.text and "step-2" in caplog.text
    with pytest.raises(MemexError, match="damaged"):
        find_checkpoint(tmp_path, str(newest))
    scheduler = tmp_path / "checkpoints" / "step-1" / "scheduler.pt"
    scheduler.write_bytes(b"x" * scheduler.stat().st_size)  # same size, other bytes: only the hash tells
    assert checkpoint_problem(tmp_path / "checkpoints" / "step-1") is not None
    with pytest.raises(MemexError, match="no checkpoint that verifies"):
        find_checkpoint(tmp_path, "latest")


def test_a_new_run_never_mixes_with_an_old_one(tmp_path):
    run = tmp_path / "run"
    opt, sched = _optimizer()
    save_checkpoint(run, 4, lambda d: None, opt, sched, {})
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    (run / "config.yaml").write_text("kept: true\n")
    (run / "pending" / "step-5").mkdir(parents=True)  # rollouts kept by a stop before step 5's update
    assert previous_run(run) == ["step-4", "metrics.jsonl"]
    with pytest.raises(MemexError, match="--resume.*--overwrite"):
        refuse_to_mix(run, overwrite=False)
    assert refuse_to_mix(run, overwrite=True)
    clear_run(run)
    assert previous_run(run) == [] and sorted(p.name for p in run.iterdir()) == ["config.yaml"]
    assert not refuse_to_mix(tmp_path / "fresh", overwrite=False)
