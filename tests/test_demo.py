"""`memexrl demo` (memexrl/demo.py): stages resume after an interrupt, never from half-written output."""

import json

import pytest

from common.config import load_config
from common.errors import MemexError
from common.preemption import RunStopped, stopped_with_resume_point
from eval.compare import table
from memexrl.demo import (
    DONE_FILE,
    QUICK_OVERRIDES,
    Demo,
    apply_precision,
    check_lme_sizes,
    check_same_config,
    run_demo,
)
from modeling.load import cpu_has_native_bf16


def test_an_interrupted_stage_starts_again_from_a_clean_directory(tmp_path):
    demo = Demo(load_config("configs/demo.yaml", []), tmp_path)
    calls = []

    def interrupted(d, where):
        (where / "half-written.jsonl").write_text("{")
        raise KeyboardInterrupt  # Ctrl-C in the middle of the stage

    with pytest.raises(KeyboardInterrupt):
        demo.run_stage("expert", interrupted)
    assert demo.done("expert") is None and not (tmp_path / "expert" / DONE_FILE).exists()

    def finished(d, where):
        calls.append(sorted(p.name for p in where.iterdir()))  # what the stage found when it started
        (where / "demos.jsonl").write_text("{}\n")
        return {"n_games": 2}

    summary = demo.run_stage("expert", finished)
    assert calls == [[]]  # the half-written file was removed first
    assert summary["n_games"] == 2 and summary["seconds"] >= 0
    assert json.loads((tmp_path / "expert" / DONE_FILE).read_text()) == summary
    # Done: a second run skips the stage (its body is not called) and returns the saved summary.
    assert demo.run_stage("expert", finished) == summary and len(calls) == 1


def test_a_stage_stopped_by_a_preemption_notice_says_how_the_demo_goes_on(tmp_path):
    """The SFT or GRPO loop's RunStopped (its own message says --resume, which the demo has not) is told in the
    demo's terms: the same command again starts the stage over; the stage is not done."""
    demo = Demo(load_config("configs/demo.yaml", []), tmp_path)

    def stopped(d, where):
        raise stopped_with_resume_point("the SFT run", 3, str(where / "trainer" / "checkpoint-3"))

    with pytest.raises(RunStopped, match="in its sft stage .after step 3.: run the same command again; it starts "
                                         "that stage over") as info:
        demo.run_stage("sft", stopped)
    assert info.value.step == 3 and "--resume" not in str(info.value) and demo.done("sft") is None


def test_a_demo_made_with_another_config_is_not_mixed_with_the_new_one(tmp_path, alfworld_data):
    out = tmp_path / "demo"
    base = [f"env.data_dir={alfworld_data}", f"demo.output_dir={out}"]
    cfg = load_config("configs/demo.yaml", base)
    out.mkdir()
    cfg.save(out / "config.yaml")
    check_same_config(cfg, out)  # the same config: fine
    other = load_config("configs/demo.yaml", [*base, "demo.eval_games=5"])
    with pytest.raises(MemexError, match=r"demo.eval_games: 3 then, 5 now.*--restart"):
        check_same_config(other, out)
    with pytest.raises(MemexError, match="--restart"):
        run_demo(other)
    assert (out / "config.yaml").is_file()  # nothing was removed without --restart


def test_the_quick_demos_expert_stage_keeps_games_that_needed_memory_for_sft_and_grpo(tmp_path, alfworld_data):
    """`memexrl demo --quick` shows memory (issue 26): its demonstrations compress and read, and GRPO plays their games."""
    from envs.data import read_games_file
    from memexrl.demo import stage_expert

    cfg = load_config("configs/demo.yaml", [*QUICK_OVERRIDES, f"env.data_dir={alfworld_data}", "env.num_workers=1"])
    demo = Demo(cfg, tmp_path)
    summary = demo.run_stage("expert", stage_expert)
    assert 2 <= summary["kept"] <= summary["n_success"] <= cfg.demo.expert_games  # SFT trains on >= 1, validates on 1
    assert summary["compress_per_episode"] >= 1 and summary["read_per_episode"] >= 1  # of the kept ones
    assert summary["segments_per_episode"] >= 2
    games = read_games_file(str(tmp_path / "expert" / "games.txt"), alfworld_data)
    demos = [json.loads(line) for line in (tmp_path / "expert" / "demos.jsonl").read_text().splitlines()]
    assert len(games) == len(demos) == summary["kept"]  # the games GRPO plays are those of the demonstrations
    assert all(d["stats"]["num_compress"] >= 1 and d["stats"]["num_read"] >= 1 for d in demos)


def test_quick_overrides_are_a_valid_smaller_config():
    full, quick = load_config("configs/demo.yaml", []), load_config("configs/demo.yaml", QUICK_OVERRIDES)
    assert quick.demo.output_dir != full.demo.output_dir  # a quick look never blocks the full demo's resume
    assert quick.demo.expert_games <= full.demo.expert_games and quick.train.steps < full.train.steps
    assert quick.train.group_size >= 4  # with 2 rollouts, often none compresses: GRPO's one segment each
    assert quick.sft.max_steps < full.sft.max_steps and quick.demo.eval_games <= full.demo.eval_games
    assert quick.demo.lme_trajectories <= full.demo.lme_trajectories and quick.demo.lme_questions <= full.demo.lme_questions
    assert quick.train.max_episode_steps <= full.train.max_episode_steps
    for cfg in (full, quick):  # memory in both: the expert's first compression comes at turn 4-7 (T 800)
        assert cfg.demo.expert_need_memory and cfg.train.max_episode_steps >= 8 and cfg.demo.eval_max_steps >= 8


def test_the_demo_computes_in_bfloat16_only_where_the_cpu_has_it_natively():
    """demo.precision auto: the SFT, rollouts and update in bfloat16 on a CPU with AVX-512 BF16 or AMX, float32 on
    one without (emulated bfloat16 runs slower there); an explicit choice is kept whatever the CPU."""
    bf16 = (True, "bfloat16", "bf16", True)
    for precision, expected in (("auto", bf16 if cpu_has_native_bf16() else None), ("float32", None),
                                ("bfloat16", bf16)):
        cfg = load_config("configs/demo.yaml", ["model.device=cpu", f"demo.precision={precision}"])
        before = (cfg.sft.bf16, cfg.rollout.dtype, cfg.train.mixed_precision, cfg.train.recompute_old_logprobs)
        apply_precision(cfg)
        now = (cfg.sft.bf16, cfg.rollout.dtype, cfg.train.mixed_precision, cfg.train.recompute_old_logprobs)
        assert now == (expected or before), precision
        cfg.check_training()  # bf16 rollouts come with the trainer's own old log-probs
    with pytest.raises(MemexError, match="demo.precision must be auto, bfloat16 or float32"):
        load_config("configs/demo.yaml", ["demo.precision=fp8"])


def test_missing_data_stops_before_anything_runs(tmp_path):
    cfg = load_config("configs/demo.yaml", [f"env.data_dir={tmp_path / 'nowhere'}", f"demo.output_dir={tmp_path / 'd'}"])
    with pytest.raises(MemexError, match="memexrl data alfworld"):
        run_demo(cfg)
    assert not (tmp_path / "d").exists()


def test_report_tables_are_markdown():
    assert table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |\n"


def test_a_bad_memex_setting_stops_before_anything_runs(tmp_path, alfworld_data):
    cfg = load_config("configs/demo.yaml", [f"demo.output_dir={tmp_path / 'd'}", "demo.lme_memex_settings=max_reads"])
    with pytest.raises(MemexError, match="demo.lme_memex_settings 'max_reads': use key=value"):
        run_demo(cfg)
    assert not (tmp_path / "d").exists()


def test_a_haystack_too_small_for_the_questions_stops_before_anything_runs(tmp_path, alfworld_data):
    cfg = load_config("configs/demo.yaml", [f"demo.output_dir={tmp_path / 'd'}", "demo.lme_trajectories=4"])
    with pytest.raises(MemexError, match="demo.lme_trajectories 4 is too few: 1 question.s. per type need 5"):
        run_demo(cfg)
    assert not (tmp_path / "d").exists()
    for overrides in ([], QUICK_OVERRIDES):  # both shipped sizes pass the check
        check_lme_sizes(load_config("configs/demo.yaml", overrides))
