"""The command line: replay end to end, and bad input stopping with one clear line (exit 2)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import subprocess
import sys

import pytest

LOOK = '{"assistant": "<tool_call>{\\"name\\": \\"execute_action\\", \\"arguments\\": {\\"action\\": \\"look\\"}}</tool_call>"}'


def memexrl(*args, env=None, cwd=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "memexrl", *args], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)


def assert_one_line_error(result, fragment):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("memexrl: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.jsonl"
    path.write_text(LOOK + "\n")
    return path


@pytest.mark.slow
def test_replay_writes_trajectory_json(alfworld_data, script, tmp_path):
    out = tmp_path / "traj.json"
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(script), "--out", str(out),
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert result.returncode == 0, result.stderr
    traj = json.loads(out.read_text())
    assert set(traj) >= {"game", "task_type", "goal", "success", "reward", "steps", "segments", "experience", "stats"}
    assert traj["steps"][0]["observation"].startswith("You are in the middle of a room")
    assert traj["end_reason"] == "script_exhausted" and len(traj["segments"]) == 1


def test_missing_data_dir(script, tmp_path):
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(script),
                     env={"ALFWORLD_DATA": str(tmp_path / "nowhere")})
    assert_one_line_error(result, "memexrl data alfworld")


def test_bad_game_path(alfworld_data, script, tmp_path):
    result = memexrl("replay", "--game", str(tmp_path / "no_such_game"), "--script", str(script),
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert_one_line_error(result, "no_such_game")
    result = memexrl("replay", "--game", "valid_seen:999", "--script", str(script),
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert_one_line_error(result, "valid_seen")


def test_corrupt_script_line(alfworld_data, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(LOOK + "\n{not json\n")
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(bad),
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert_one_line_error(result, "line 2")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"text": "hi"}\n')
    assert_one_line_error(memexrl("replay", "--game", "valid_seen:0", "--script", str(wrong),
                                  env={"ALFWORLD_DATA": str(alfworld_data)}), '"assistant"')


def test_bad_config(alfworld_data, script, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("memory:\n  treshold: 100\n")
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(script), "--config", str(config),
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert_one_line_error(result, "unknown key memory.treshold")
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(script), "memory.threshold=abc",
                     env={"ALFWORLD_DATA": str(alfworld_data)})
    assert_one_line_error(result, "memory.threshold must be int")
    result = memexrl("replay", "--game", "valid_seen:0", "--script", str(script), "--config", str(tmp_path / "x.yaml"))
    assert_one_line_error(result, "config file not found")


def test_data_command_with_missing_archive(tmp_path):
    result = memexrl("data", "alfworld", "--dest", str(tmp_path / "d"), "--archive", str(tmp_path / "none.tar.gz"))
    assert_one_line_error(result, "none.tar.gz")


def test_data_command_is_idempotent(alfworld_data):
    result = memexrl("data", "alfworld", "--dest", str(alfworld_data))
    assert result.returncode == 0 and f"ALFWORLD_DATA={alfworld_data}" in result.stdout


def test_demo_with_a_changed_config_is_one_clear_error(alfworld_data, tmp_path):
    out = tmp_path / "demo"
    first = memexrl("demo", "--out", str(out), f"env.data_dir={alfworld_data}", "demo.expert_games=0")
    assert_one_line_error(first, "demo.expert_games")
    out.mkdir()
    (out / "config.yaml").write_text("demo:\n  eval_games: 9\n")
    second = memexrl("demo", "--out", str(out), f"env.data_dir={alfworld_data}")
    assert_one_line_error(second, "--restart")


def test_train_into_a_directory_holding_a_run_stops_before_touching_it(alfworld_data, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-4").mkdir(parents=True)
    (run / "checkpoints" / "step-4" / "trainer_state.json").write_text('{"step": 4}')
    (run / "metrics.jsonl").write_text('{"step": 4}\n')
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    env = {"ALFWORLD_DATA": str(alfworld_data)}
    result = memexrl("train", "--config", "configs/tiny-cpu.yaml", f"train.output_dir={run}", env=env)
    assert_one_line_error(result, "holds a run (step-4, metrics.jsonl): continue it with --resume, start over "
                                  "with --overwrite")
    assert_one_line_error(memexrl("train", "--config", "configs/tiny-cpu.yaml", "--resume", "--overwrite",
                                  f"train.output_dir={run}", env=env), "give one of them")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert (run / "metrics.jsonl").read_text() == '{"step": 4}\n'


def test_overrides_may_follow_options_in_the_order_written():
    """The configs' headers write `--out X env.max_steps=20 --samples 3 eval.temperature=0.7`: every override is
    taken, in order (plain argparse rejected the ones after `--samples`); a stray word is still an error."""
    from memexrl.cli import build_parser, parse_command_line

    parser = build_parser()
    args = parse_command_line(parser, ["eval", "alfworld", "--checkpoint", "ck", "--out", "o", "env.max_steps=20",
                                       "--samples", "3", "eval.temperature=0.7", "env.max_steps=16"])
    assert args.samples == 3 and args.overrides == ["env.max_steps=20", "eval.temperature=0.7", "env.max_steps=16"]
    with pytest.raises(SystemExit):
        parse_command_line(parser, ["eval", "alfworld", "--checkpoint", "ck", "a.b=1", "--samples", "3", "stray"])
    with pytest.raises(SystemExit):
        parse_command_line(parser, ["data", "alfworld", "--dest", "d", "env.max_steps=20"])  # takes no overrides


def test_an_unknown_option_is_one_usage_error(tmp_path):
    result = memexrl("eval", "alfworld", "--checkpoint", str(tmp_path), "--no-such-option", "a.b=1")
    assert result.returncode == 2 and "unrecognized arguments: --no-such-option" in result.stderr
