"""`memexrl eval alfworld` (eval/alfworld.py) and the M² insight bank (eval/m2_insights.py)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402

import pytest  # noqa: E402

from common.config import load_config  # noqa: E402
from common.trajectory import Segment, Step, Trajectory  # noqa: E402
from envs.data import TASK_TYPES, task_type_of  # noqa: E402
from eval.alfworld import RESULT_FILE, aggregate, eval_games  # noqa: E402
from eval.compare import load_result  # noqa: E402
from eval.m2_insights import InsightBank, distill, strip_ids  # noqa: E402
from memexrl.cli import main  # noqa: E402


def test_stratified_subset_is_deterministic(alfworld_data):
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "eval.split=valid_unseen", "eval.games=12"])
    games = eval_games(cfg)
    assert games == eval_games(cfg) and len(games) == 12 and len(set(games)) == 12
    assert {task_type_of(g) for g in games[: len(TASK_TYPES)]} == set(TASK_TYPES)  # every type, in turn
    assert len(eval_games(load_config(None, [f"env.data_dir={alfworld_data}", "eval.split=valid"]))) == 140 + 134
    two_types = eval_games(load_config(None, [f"env.data_dir={alfworld_data}", "eval.split=valid_unseen",
                                              "eval.games=6", "eval.task_types=pick_two_obj_and_place,"
                                              "pick_heat_then_place_in_recep"]))
    assert [task_type_of(g) for g in two_types] == ["pick_heat_then_place_in_recep", "pick_two_obj_and_place"] * 3


def traj(task_type, success, peak, compress=0, read=0, total=0.0, rejected=0, missed=0):
    t = Trajectory(game=f"g-{task_type}-{peak}", task_type=task_type, goal="", success=success,
                   reward={"total": total}, end_reason="env_done" if success else "step_limit")
    t.steps = [Step("a", "execute_action", {"action": "look"}, False, None, "o", peak)]
    t.steps += [Step("c", "CompressExperience", {}, False, None, "s", 10, compressed=True)] * compress
    t.steps += [Step("c", "CompressExperience", {}, False, "anchor not found", "e", 10)] * rejected
    t.steps += [Step("r", "ReadExperience", {"db_index": "x"}, False, None, "b", 20)] * read
    t.steps += [Step("r", "ReadExperience", {"db_index": "y"}, False, "no index 'y'", "e", 20)] * missed
    t.segments = [Segment(first_step=0, prompt_ids=[1]) for _ in range(compress + 1)]
    return t.to_json()  # aggregate() reads the trajectory JSON episodes.jsonl holds


def test_aggregate_by_hand():
    result = aggregate([traj("pick_and_place_simple", True, 1000, compress=2, read=1, total=1.0, missed=2),
                        traj("pick_and_place_simple", False, 3000, total=-0.5, rejected=3),
                        traj("look_at_obj_in_light", True, 500, compress=1, total=0.9)])
    assert result["n_games"] == 3 and result["success_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["by_task_type"] == {"look_at_obj_in_light": {"games": 1, "success": 1, "success_rate": 1.0},
                                      "pick_and_place_simple": {"games": 2, "success": 1, "success_rate": 0.5}}
    assert result["peak_working_tokens_mean"] == 1500 and result["peak_working_tokens_max"] == 3000
    assert result["num_compress_mean"] == 1.0 and result["num_read_mean"] == pytest.approx(1 / 3, abs=1e-4)
    assert result["num_compress_rejected_mean"] == 1.0 and result["num_read_miss_mean"] == pytest.approx(2 / 3, abs=1e-4)
    assert result["num_segments_mean"] == 2.0  # 3, 1 and 2 segments: a segment per accepted compression, plus one
    assert result["reward_mean"] == pytest.approx(0.4667, abs=1e-4)
    assert result["end_reasons"] == {"env_done": 2, "step_limit": 1}


def test_an_episode_that_ends_repeating_a_failing_call_is_counted_as_an_error_loop():
    """The diagnostic of issue 26's runs: the policy retries a refused call until the step limit."""
    looping = traj("pick_and_place_simple", False, 900, rejected=5)  # look, then 5 refused compressions
    short = traj("pick_and_place_simple", False, 900, rejected=4)  # 4: not yet a loop
    won = traj("pick_and_place_simple", True, 900, rejected=5)  # a win is never a loop
    formats = traj("pick_and_place_simple", False, 900, rejected=2)
    formats["steps"] += [Step("cut", None, None, True, "Format error: unclosed <tool_call>", "e", 30).to_json()] * 3
    recovered = traj("pick_and_place_simple", False, 900, rejected=6, read=1)  # the last turn is a read that hit
    result = aggregate([looping, short, won, formats, recovered])
    assert result["error_loop_rate"] == pytest.approx(2 / 5)


def solved(goal, actions):
    steps = [{"tool": "execute_action", "arguments": {"action": a}, "observation": "ok"} for a in actions]
    return {"goal": goal, "success": True, "steps": steps}


HEAT = solved("Your task is to: heat some apple and put it in countertop.",
              ["look", "go to fridge 1", "open fridge 1", "go to countertop 2", "take apple 3 from countertop 2",
               "go to microwave 1", "heat apple 3 with microwave 1", "go to countertop 1",
               "move apple 3 to countertop 1"])
LAMP = solved("Your task is to: examine the alarmclock with the desklamp.",
              ["look", "go to desk 1", "take alarmclock 2 from desk 1", "go to sidetable 1", "use desklamp 1"])
COOL = solved("Your task is to: cool some tomato and put it in garbagecan.",
              ["go to countertop 1", "take tomato 1 from countertop 1", "go to fridge 1",
               "cool tomato 1 with fridge 1", "go to garbagecan 1", "move tomato 1 to garbagecan 1"])


def test_distill_strips_the_game_literals():
    key, insight = distill(HEAT)
    assert key == "Your task is to: heat some apple and put it in countertop"
    assert "a apple was found at countertop (after checking fridge)" in insight
    assert "heat it with microwave" in insight and "put it in/on countertop" in insight
    assert not any(ch.isdigit() for ch in insight)
    assert strip_ids("take apple 12 from countertop 3") == "take apple from countertop"
    assert distill({**HEAT, "success": False}) is None


@pytest.mark.slow
def test_insight_retrieval_on_real_embeddings(tmp_path):
    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in (HEAT, LAMP, COOL, {**LAMP, "success": False})))
    bank = InsightBank.from_trajectories([path])
    assert len(bank.insights) == 3
    assert bank.retrieve("Your task is to: look at the book under the desklamp.", k=1)[0].startswith(
        "Your task is to: examine the alarmclock")
    top = bank.retrieve("Your task is to: put a hot potato in the countertop.", k=2)
    assert top[0].startswith("Your task is to: heat some apple")
    bank.save(tmp_path / "bank.json")
    again = InsightBank.load(tmp_path / "bank.json")
    assert again.retrieve("Your task is to: put a hot potato in the countertop.", k=2) == top


@pytest.mark.slow
def test_cli_writes_results_and_episodes(alfworld_data, tiny_eos_model, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", "alfworld", "--checkpoint", tiny_eos_model, "--split", "valid_unseen", "--games", "3",
                 "--agent", "truncate", "--out", str(out), f"env.data_dir={alfworld_data}", "env.max_steps=3",
                 "env.num_workers=1", "rollout.max_new_tokens=12"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / RESULT_FILE).read_text())
    assert result["split"] == "valid_unseen" and result["n_games"] == 3 and result["agent"] == "truncate"
    for key in ("success_rate", "by_task_type", "peak_working_tokens_mean", "num_compress_mean", "num_read_mean",
                "reward_mean"):
        assert key in result
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 and all(len(e["steps"]) == 3 for e in episodes)
    assert "truncate on 3 valid_unseen games" in capsys.readouterr().out


@pytest.mark.slow
def test_samples_per_game_plays_each_game_that_many_times_with_different_samples(alfworld_data, tiny_eos_model,
                                                                                  tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", "alfworld", "--checkpoint", tiny_eos_model, "--split", "valid_unseen", "--games", "2",
                 "--samples", "2", "--out", str(out), f"env.data_dir={alfworld_data}", "env.max_steps=2",
                 "env.num_workers=1", "rollout.max_new_tokens=12", "eval.temperature=1.0", "seed=3"])
    assert code == 0, capsys.readouterr().err
    result = json.loads((out / RESULT_FILE).read_text())
    assert result["n_games"] == 4 and result["samples_per_game"] == 2 and result["seed"] == 3
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    games = [e["game"] for e in episodes]
    assert games[0] == games[1] != games[2] == games[3]  # game by game, its samples side by side
    replies = [[s["assistant"] for s in e["steps"]] for e in episodes]
    assert replies[0] != replies[1] and replies[2] != replies[3]  # sampled, not one episode copied
    assert "4 episodes (2 valid_unseen games x 2)" in capsys.readouterr().out


@pytest.mark.slow
def test_an_interrupted_sampled_evaluation_continues_with_the_episodes_of_an_uninterrupted_one(
        alfworld_data, tiny_eos_model, tmp_path, capsys, monkeypatch):
    """A 3-hour evaluation on one core is played in parts: rerunning the command continues with the next round."""
    import rollout.runner

    args = ["eval", "alfworld", "--checkpoint", tiny_eos_model, "--split", "valid_unseen", "--games", "2",
            "--samples", "3", f"env.data_dir={alfworld_data}", "env.max_steps=2", "env.num_workers=1",
            "rollout.max_new_tokens=12", "eval.temperature=1.0", "seed=5"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0, capsys.readouterr().err
    whole = (tmp_path / "whole" / "episodes.jsonl").read_text()
    assert not (tmp_path / "whole" / "partial.json").exists()

    real_run, calls = rollout.runner.run_episodes, []

    def interrupted_in_round_2(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the session ends while round 2 plays
        return real_run(*a, **kw)

    monkeypatch.setattr(rollout.runner, "run_episodes", interrupted_in_round_2)
    out = tmp_path / "parts"
    assert main([*args, "--out", str(out)]) == 130  # Ctrl-C
    assert not (out / RESULT_FILE).exists() and len(json.loads((out / "partial.json").read_text())["rounds"]) == 1
    # the same directory with another setting is refused, and its finished round kept
    assert main([*args[:-1], "seed=6", "--out", str(out)]) == 2
    assert "partial evaluation of another setting (seed: 5, now 6)" in capsys.readouterr().err
    assert (out / "partial.json").exists()
    assert main([*args, "rollout.dtype=bfloat16", "--out", str(out)]) == 2  # another engine precision too
    assert "(engine: 'transformers float32', now 'transformers bfloat16')" in capsys.readouterr().err
    partial = json.loads((out / "partial.json").read_text())  # a partial file from before the engine was recorded
    del partial["setting"]["engine"]
    (out / "partial.json").write_text(json.dumps(partial))
    assert main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    assert len(calls) == 4  # rounds 2 and 3 only: round 1 was not played again
    assert (out / "episodes.jsonl").read_text() == whole  # the episodes of the uninterrupted run
    assert json.loads((out / RESULT_FILE).read_text())["n_games"] == 6 and not (out / "partial.json").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--samples", "2"], "needs eval.temperature > 0"),
    (["eval.samples_per_game=0"], "eval.samples_per_game must be >= 1"),
    (["--agent", "oracle"], "eval.agent must be one of"),
    (["--agent", "m2"], "needs eval.insights_from"),
    (["--split", "test"], "split"),
    (["--task-types", "pick_and_boil"], "unknown ALFWorld task type(s) pick_and_boil"),
])
def test_cli_bad_input_exits_2(alfworld_data, tmp_path, capsys, args, fragment):
    code = main(["eval", "alfworld", "--out", str(tmp_path / "o"), *args, f"env.data_dir={alfworld_data}"])
    assert code == 2 and fragment in capsys.readouterr().err
    assert not (tmp_path / "o" / RESULT_FILE).exists()


def write_result(directory, agent, success, peak):
    directory.mkdir(parents=True)
    result = {"split": "valid_unseen", "agent": agent, "checkpoint": "/x/runs/sft/checkpoints/step-42",
              **aggregate([traj("pick_and_place_simple", s, p) for s, p in zip(success, peak)])}
    (directory / RESULT_FILE).write_text(json.dumps(result))


def test_compare_writes_a_table_and_a_chart(tmp_path, capsys):
    write_result(tmp_path / "memex", "memex", [True, False], [800, 1200])
    write_result(tmp_path / "full", "full", [False, False], [4000, 6000])
    assert main(["eval", "compare", str(tmp_path / "cmp"), str(tmp_path / "memex"), str(tmp_path / "full")]) == 0
    table = (tmp_path / "cmp" / "compare.md").read_text()
    lines = table.splitlines()
    assert lines[0].startswith("| run | agent |") and len(lines) == 4
    assert "| compress/ep | rejected/ep | read/ep | missed/ep | segments/ep |" in lines[0]
    assert lines[0].endswith("| format err/ep | error loop % | reward |")
    assert lines[2].startswith("| memex | memex | step-42 | valid_unseen | 2 | 50.0 | 1000 | 1200 |")
    assert lines[3].startswith("| full | full | step-42 | valid_unseen | 2 | 0.0 | 5000 | 6000 |")
    png = (tmp_path / "cmp" / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert table in capsys.readouterr().out
    # the chart's T line comes from the config the evaluation saved; a directory without one has none
    (tmp_path / "memex" / "config.yaml").write_text("memory:\n  threshold: 800\n")
    assert load_result(tmp_path / "memex")["memory_threshold"] == 800
    assert load_result(tmp_path / "full")["memory_threshold"] is None
    # a result written before the error-loop metric existed: the column comes from its episodes
    old = tmp_path / "old"
    write_result(old, "memex", [False], [900])
    result = json.loads((old / RESULT_FILE).read_text())
    del result["error_loop_rate"]
    (old / RESULT_FILE).write_text(json.dumps(result))
    (old / "episodes.jsonl").write_text(json.dumps(traj("pick_and_place_simple", False, 900, rejected=5)) + "\n")
    assert main(["eval", "compare", str(tmp_path / "cmp2"), str(old)]) == 0
    assert "| 0.00 | 100.0 | 0.000 |" in (tmp_path / "cmp2" / "compare.md").read_text()
    assert main(["eval", "compare", str(tmp_path / "cmp"), str(tmp_path / "missing")]) == 2
    assert "run `memexrl eval alfworld" in capsys.readouterr().err


@pytest.mark.parametrize("config", ["configs/tiny-cpu.yaml", "configs/paper-8gpu.yaml", "configs/h200-lora.yaml"])
def test_configs_evaluate_with_the_release_protocol(config):
    """The release tests on valid_seen + valid_unseen, greedy, one sample per game, 50 steps (memex.md)."""
    cfg = load_config(config)
    assert (cfg.eval.split, cfg.eval.games, cfg.eval.temperature, cfg.env.max_steps) == ("valid", 0, 0.0, 50)
    assert cfg.eval.agent == "memex"
