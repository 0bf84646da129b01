"""SFT data and the warm start: segment conversations equal the agent loop's contexts,
assistant-only masks, a deterministic split by game, and a tiny TRL run end to end."""

import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import pytest
import torch
import yaml

from common.config import load_config
from common.errors import MemexError
from common.preemption import RunStopped
from envs.data import TASK_TYPES, resolve_game
from memory.parsing import render_tool_call
from rollout.runner import make_renderer, open_envs, run_episodes
from rollout.scripted import ScriptedEngine
from sft.dataset import build_dataset, game_id, load_demonstrations, segment_rows, split_games


def call(name, **arguments):
    return render_tool_call(name, arguments, "Next.")


SCRIPT = [
    call("execute_action", action="look"),
    call("CompressExperience", summary="room: the overview",
         db_blocks=[{"db_index": "room", "start_anchor": "You are in", "mid_anchor": "you see", "end_anchor": "."}]),
    call("ReadExperience", db_index="room"),
    call("execute_action", action="inventory"),
]


@pytest.fixture(scope="module")
def demos_file(tmp_path_factory, alfworld_data, smol_tokenizer):
    """Real replays on four valid_seen games written as demos.jsonl (marked successful for the data tests)."""
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "memory.threshold=1000"])
    jobs = [(f"d{i}", str(resolve_game(f"valid_seen:{i}", alfworld_data))) for i in range(4)]
    engine = ScriptedEngine(smol_tokenizer, {eid: SCRIPT for eid, _ in jobs})
    with open_envs(cfg, 0) as envs:
        trajs = run_episodes(jobs, engine, envs, make_renderer(smol_tokenizer, cfg), cfg)
    path = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    with open(path, "w") as f:
        for t in trajs:
            f.write(json.dumps({**t.to_json(with_tokens=True), "success": True}) + "\n")
    return path, trajs, make_renderer(smol_tokenizer, cfg)


def test_segment_rows_are_the_loop_contexts_with_assistant_masks(demos_file):
    path, trajs, renderer = demos_file
    rows, counts = segment_rows(load_demonstrations(path), max_length=8192)
    assert counts["segments"] == sum(len(t.segments) for t in trajs) == 8 and len(rows) == 8
    for row, seg in zip(rows, [s for t in trajs for s in t.segments]):
        assert row["input_ids"] == seg.prompt_ids + seg.completion_ids
        messages = json.loads(row["messages"])
        assert messages == seg.messages  # exactly the context the loop built
        # Masked-in tokens are exactly the assistant turns; everything else is masked out.
        trained = renderer.decode([t for t, m in zip(row["input_ids"], row["assistant_masks"]) if m])
        assistant = "".join(m["content"] + renderer.eos_text for m in messages if m["role"] == "assistant")
        assert trained == assistant
        assert row["assistant_masks"][: len(seg.prompt_ids)] == [0] * len(seg.prompt_ids)
    # Segment 2 starts from [system, task, summary].
    assert [m["role"] for m in json.loads(rows[1]["messages"])][:3] == ["system", "user", "user"]


def test_split_is_by_game_and_deterministic(demos_file):
    path, trajs, _ = demos_file
    games = [t.game for t in trajs]
    train, val = split_games(games, 0.25)
    assert len(val) == 1 and len(train) == 3 and not train & val
    assert split_games(list(reversed(games)), 0.25) == (train, val)
    data = build_dataset(path, validation_fraction=0.25)
    assert {r["game"] for r in data["validation"]} == val
    assert {r["game"] for r in data["train"]} == train
    assert game_id("/x/json_2.1.1/valid_seen/task-A/trial_1/game.tw-pddl") == "valid_seen/task-A/trial_1"


def test_too_long_segments_are_dropped_and_counted(demos_file):
    path, _, _ = demos_file
    rows, counts = segment_rows(load_demonstrations(path), max_length=600)
    assert counts["too_long"] > 0 and all(len(r["input_ids"]) <= 600 for r in rows)


def test_bad_demonstration_files(tmp_path):
    with pytest.raises(MemexError, match="memexrl expert"):
        load_demonstrations(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"game": "g"}\n')
    with pytest.raises(MemexError, match="line 1: missing field 'task_type'"):
        load_demonstrations(bad)
    no_tokens = tmp_path / "plain.jsonl"
    no_tokens.write_text(json.dumps({"game": "g", "task_type": "t", "success": True, "steps": [],
                                     "segments": [{"first_step": 0}]}) + "\n")
    with pytest.raises(MemexError, match="regenerate the demonstrations"):
        load_demonstrations(no_tokens)


@pytest.mark.slow
def test_tiny_sft_run_end_to_end(demos_file, tmp_path, alfworld_data):
    """TRL SFT with LoRA on the real SmolLM2 for two steps: run dir, metrics, an adapter that loads."""
    from modeling.load import load_policy
    from sft.train import run_sft

    path, _, _ = demos_file
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"env.data_dir={alfworld_data}", "model.device=cpu", f"sft.demos={path}", f"sft.output_dir={run}",
        "sft.max_steps=2", "sft.logging_steps=1", "sft.per_device_batch_size=1", "sft.max_length=1200",
        "sft.validation_fraction=0.25", "sft.wandb=false", "sft.save_steps=1",
    ])
    checkpoint = run_sft(cfg)
    assert checkpoint == run / "checkpoints" / "step-2" and (checkpoint / "adapter_config.json").is_file()
    assert (run / "checkpoints" / "step-1").is_dir()
    assert not list((run / "checkpoints").glob(".tmp-*"))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["sft"]["max_steps"] == 2
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert any("eval_loss" in m for m in metrics)
    model, tokenizer = load_policy(cfg.model.__class__(name=str(checkpoint), device="cpu"))
    assert tokenizer.eos_token == "<|im_end|>" and not hasattr(model, "peft_config")  # merged for inference


@pytest.mark.slow
def test_the_plain_output_head_trains_as_trls_fused_one(demos_file, tmp_path, alfworld_data):
    """sft.output_head=plain (the CPU's default) logs the same losses, entropy, token accuracy and token counts as
    TRL's fused output layer, step for step and on the validation set: step 2's loss and the validation loss are
    those of the weights step 1's gradients moved (at a learning rate that moves the loss)."""
    from sft.train import run_sft

    path, _, _ = demos_file
    runs = {}
    for head in ("fused", "plain"):
        cfg = load_config(None, [
            f"env.data_dir={alfworld_data}", "model.device=cpu", f"sft.demos={path}", f"sft.output_dir={tmp_path / head}",
            "sft.max_steps=2", "sft.logging_steps=1", "sft.max_length=1200", "sft.validation_fraction=0.25",
            "sft.wandb=false", "sft.save_steps=10", "sft.learning_rate=1e-3", "sft.warmup_ratio=0",
            "sft.gradient_accumulation_steps=1", f"sft.output_head={head}",
        ])
        run_sft(cfg)
        runs[head] = [json.loads(line) for line in (tmp_path / head / "metrics.jsonl").read_text().splitlines()]
    fused, plain = runs["fused"], runs["plain"]
    assert fused[1]["loss"] < fused[0]["loss"] - 0.05  # the first step moved the weights
    keys = ("loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy", "eval_mean_token_accuracy")
    logged = [(f[k], p[k]) for f, p in zip(fused, plain, strict=True) for k in keys if k in f]
    assert len(logged) >= 8
    for a, b in logged:
        assert a == pytest.approx(b, rel=2e-3, abs=1e-4)


@pytest.mark.slow
def test_an_interrupted_sft_run_resumes_to_the_uninterrupted_weights(demos_file, tmp_path, alfworld_data, monkeypatch):
    """`memexrl sft --resume` (the CPU memory run's SFT, in parts): a run that gets a SIGTERM (a preemption
    notice, or `kill -TERM` at the end of a session) during step 1 finishes that step, writes both checkpoints
    there although save_steps is 2, and stops with RunStopped; resumed, it continues with its optimizer,
    schedule and data order (two segments a step: accumulation crosses the resume), ends with the adapter of a
    run that was never stopped, and its metrics.jsonl has each step once."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import sft.train as sft_train

    path, _, _ = demos_file  # 8 segments of 676-921 tokens: max_length 800 keeps 4, one epoch of 2 steps x 2

    def config(run):
        return load_config(None, [
            f"env.data_dir={alfworld_data}", "model.device=cpu", f"sft.demos={path}", f"sft.output_dir={run}",
            "sft.max_steps=2", "sft.logging_steps=1", "sft.per_device_batch_size=1", "sft.max_length=800",
            "sft.gradient_accumulation_steps=2", "sft.validation_fraction=0", "sft.wandb=false", "sft.save_steps=2",
        ])

    whole = sft_train.run_sft(config(tmp_path / "whole"))
    run = tmp_path / "parts"
    with pytest.raises(MemexError, match="no SFT checkpoint to resume"):
        sft_train.run_sft(config(run), resume=True)

    class TermDuringStep1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    callbacks, handler = sft_train._callbacks, signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(sft_train, "_callbacks", lambda *a: [*callbacks(*a), TermDuringStep1()])
    with pytest.raises(RunStopped, match="after step 1; its resume point is .*checkpoint-1: .* --resume") as stopped:
        sft_train.run_sft(config(run))
    assert stopped.value.step == 1 and signal.getsignal(signal.SIGTERM) == handler  # restored after the run
    monkeypatch.setattr(sft_train, "_callbacks", callbacks)
    assert sft_train.resume_point(run).name == "checkpoint-1" and (run / "checkpoints" / "step-1").is_dir()
    resumed = sft_train.run_sft(config(run), resume=True)
    assert resumed.name == whole.name == "step-2"
    a, b = load_file(whole / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == [1, 2]


def test_task_types_keep_only_those_demonstrations(demos_file):
    path, trajs, _ = demos_file
    kept = trajs[0].task_type
    data = build_dataset(path, validation_fraction=0.0, task_types=kept)
    expected = {game_id(t.game) for t in trajs if t.task_type == kept}
    assert {r["game"] for r in data["train"]} == expected
    assert {r["task_type"] for r in data["train"]} == {kept}
    absent = next(t for t in TASK_TYPES if t not in {tr.task_type for tr in trajs})  # 4 games, 6 types
    with pytest.raises(MemexError, match="no winning demonstration of task type"):
        build_dataset(path, task_types=absent)
    with pytest.raises(MemexError, match="unknown ALFWorld task type"):
        build_dataset(path, task_types="pick_and_plaice")


@pytest.mark.slow
def test_sft_bf16_on_the_cpu_trains_where_it_is_native_and_says_what_to_fix_where_not(demos_file, tmp_path,
                                                                                       alfworld_data, monkeypatch):
    """sft.bf16=true on the CPU: bfloat16 autocast where the CPU computes bfloat16 natively (AVX-512 BF16 / AMX:
    the same first-step loss as float32 to 2 %); on a CPU without it, one error that says to set it false."""
    import sft.train as sft_train

    path, _, _ = demos_file

    def config(run, bf16):
        return load_config(None, [
            f"env.data_dir={alfworld_data}", "model.device=cpu", f"sft.demos={path}", f"sft.output_dir={run}",
            "sft.max_steps=1", "sft.logging_steps=1", "sft.max_length=1200", "sft.validation_fraction=0.0",
            "sft.wandb=false", f"sft.bf16={bf16}",
        ])

    def first_loss(run):
        return next(json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                    if "loss" in json.loads(line))

    monkeypatch.setattr(sft_train, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(MemexError, match="set sft.bf16=false"):
        sft_train.run_sft(config(tmp_path / "no-native", "true"))
    monkeypatch.undo()
    if not sft_train.cpu_has_native_bf16():
        pytest.skip("this CPU has no native bfloat16 (AVX-512 BF16 or AMX)")
    bf16 = sft_train.run_sft(config(tmp_path / "bf16", "true"))
    sft_train.run_sft(config(tmp_path / "fp32", "false"))
    assert (bf16 / "adapter_config.json").is_file()
    assert first_loss(tmp_path / "bf16") == pytest.approx(first_loss(tmp_path / "fp32"), rel=0.02)
