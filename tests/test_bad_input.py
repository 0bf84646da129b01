"""Every bad input gets one clear line and exit 2, before anything is written (issue 24, 7)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from common.config import load_config
from common.errors import MemexError
from common.jsonl import read_jsonl
from memexrl.cli import main

LOOK = '{"assistant": "<tool_call>{\\"name\\": \\"execute_action\\", \\"arguments\\": {\\"action\\": \\"look\\"}}</tool_call>"}'
BINARY = bytes(range(256)) * 4


def exit_code_and_error(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize("override, fragment", [
    ("train.learning_rate=nan", "train.learning_rate must be a finite number"),
    ("train.learning_rate=.inf", "train.learning_rate must be a finite number"),
    ("rollout.batch_size=0", "rollout.batch_size must be > 0"),
    ("train.num_games=-1", "train.num_games must be >= 0"),
    ("train.max_episode_steps=-3", "train.max_episode_steps must be >= 0"),
    ("rollout.max_context_tokens=0", "rollout.max_context_tokens must be > 0"),
    ("env.step_timeout_s=0", "env.step_timeout_s must be > 0"),
    ("rollout.vllm_request_timeout_s=0", "rollout.vllm_request_timeout_s must be > 0"),
    ("rollout.vllm_cpu_reserved_cores=-2", "rollout.vllm_cpu_reserved_cores must be >= 0, got -2"),
    ("seed=-1", "seed must be >= 0"),
])
def test_bad_numbers_stop_even_a_dry_run(override, fragment, capsys):
    code, err = exit_code_and_error(["train", "--config", "configs/tiny-cpu.yaml", "--dry-run", override], capsys)
    assert code == 2 and f"memexrl: error: bad config: {fragment}" in err


def test_a_training_setting_stops_a_dry_run_but_not_eval(capsys):
    """rollout.dtype apart from model.dtype needs recomputed old log-probs for the PPO ratio: `train` and its dry run
    stop on it; the same config loads for `eval`, which computes no ratio (common/config.py check_training)."""
    overrides = ["rollout.dtype=bfloat16", "train.recompute_old_logprobs=false"]
    code, err = exit_code_and_error(["train", "--config", "configs/tiny-cpu.yaml", "--dry-run", *overrides], capsys)
    assert code == 2 and "memexrl: error: bad config: rollout.dtype=bfloat16" in err
    assert "set train.recompute_old_logprobs=true" in err
    assert load_config("configs/tiny-cpu.yaml", overrides).engine_dtype == "bfloat16"


def test_binary_config_and_script_are_one_line_each(alfworld_data, tmp_path, capsys):
    binary = tmp_path / "blob"
    binary.write_bytes(BINARY)
    script = tmp_path / "script.jsonl"
    script.write_text(LOOK + "\n")
    code, err = exit_code_and_error(["replay", "--game", "valid_seen:0", "--script", str(script),
                                     "--config", str(binary)], capsys)
    assert code == 2 and "cannot be read as a YAML text file" in err
    code, err = exit_code_and_error(["replay", "--game", "valid_seen:0", "--script", str(binary),
                                     f"env.data_dir={alfworld_data}"], capsys)
    assert code == 2 and "cannot be read as a UTF-8 text file" in err
    with pytest.raises(MemexError, match="cannot be read as a UTF-8 text file"):  # questions.jsonl, demos, ...
        read_jsonl(binary, "questions not found", "one question per line")


def test_replay_refuses_an_empty_script_and_a_missing_out_directory_before_playing(alfworld_data, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "t.json"
    code, err = exit_code_and_error(["replay", "--game", "valid_seen:0", "--script", str(empty), "--out", str(out),
                                     f"env.data_dir={alfworld_data}"], capsys)
    assert code == 2 and "has no turns" in err and not out.exists()
    script = tmp_path / "script.jsonl"
    script.write_text(LOOK + "\n")
    missing = tmp_path / "missing" / "t.json"
    code, err = exit_code_and_error(["replay", "--game", "valid_seen:0", "--script", str(script), "--out",
                                     str(missing), f"env.data_dir={alfworld_data}"], capsys)
    assert code == 2 and "does not exist; create it first" in err


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "store", "--blocks", "-5"], "invalid positive_int value: '-5'"),
    (["expert", "--split", "train", "--games", "0", "--out", "x"], "--games must be >= 1"),
    (["eval", "alfworld", "--config", "configs/tiny-cpu.yaml", "--split", "valid_seen", "--games", "-2"],
     "invalid non_negative_int value"),
])
def test_bad_counts_are_usage_errors(argv, fragment, capsys):
    code, err = exit_code_and_error(argv, capsys)
    assert code == 2 and fragment in err


def test_eval_with_a_checkpoint_that_does_not_load_leaves_no_output_directory(alfworld_data, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    out = tmp_path / "eval"
    code, err = exit_code_and_error(["eval", "alfworld", "--config", "configs/tiny-cpu.yaml", "--split", "valid_seen",
                                     "--games", "1", "--checkpoint", str(broken), "--out", str(out),
                                     f"env.data_dir={alfworld_data}"], capsys)
    assert code == 2 and "memexrl: error:" in err
    assert not out.exists()
