"""The GRPO trainer end to end on real ALFWorld games with a tiny model (training/trainer.py).

The tiny random model never ends a turn by itself, so every rollout of a game would tie and
GRPO would drop the group. `tiny_eos_model` gives its end-of-turn token a random output row:
turn lengths then vary, the working context W varies, and with a small threshold T the
context penalty differs between the G rollouts of a game, which is all GRPO needs.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from common.config import load_config
from memexrl.cli import main

pytestmark = pytest.mark.slow


def overrides(model_dir: str, run_dir, **extra) -> list[str]:
    base = {
        "model.name": model_dir, "model.device": "cpu", "train.finetune": "lora", "train.tasks_per_step": 1,
        "train.group_size": 4, "train.global_batch_size": 4, "train.micro_batch_size": 4, "train.steps": 4,
        "train.num_games": 3, "train.wandb": False, "train.output_dir": str(run_dir), "train.learning_rate": 2e-4,
        "env.max_steps": 3, "env.num_workers": 1, "rollout.max_new_tokens": 24, "memory.threshold": 200,
        "train.init_checkpoint": "", "train.max_episode_steps": 0, "train.recompute_old_logprobs": True,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def run(args: list[str]) -> int:
    return main(["train", "--config", "configs/tiny-cpu.yaml", *args])


def adapter(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step}" / "adapter_model.safetensors"))


def test_run_directory_metrics_and_checkpoint(tiny_eos_model, tmp_path, alfworld_data, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    monkeypatch.setenv("WANDB_MODE", "offline")
    from rollout.hf_engine import TransformersEngine

    calls = []  # a colocated vLLM wakes up into memory PyTorch's cache has given back
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(TransformersEngine, "wake_up", lambda self: calls.append("wake_up"))
    run_dir = tmp_path / "run"
    assert run(overrides(tiny_eos_model, run_dir, **{"train.steps": 2, "train.save_steps": 1,
                                                     "train.wandb": True})) == 0
    assert calls.count("wake_up") == 2
    assert all(calls[i - 1] == "empty_cache" for i, call in enumerate(calls) if call == "wake_up")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    design_keys = {"step", "success_rate", "reward_mean", "penalty_context", "penalty_redundancy", "penalty_format",
                   "peak_working_tokens", "num_compress", "num_read", "num_segments", "loss", "kl", "approx_kl",
                   "clip_frac", "tis_clip_frac", "grad_norm", "lr", "rollout_s", "train_s"}
    for r in records:
        assert design_keys <= r.keys()
        assert r["num_updates"] == 1 and r["num_samples"] >= 4  # rewards differed: the group was trained on
        assert r["zero_std_group_frac"] == 0.0
        assert r["penalty_context"] > 0 and r["reward_mean"] < 0
        assert r["grad_norm"] > 0
        # one update per step: the loss is taken before the policy moves from the rollout's (approx-KL ~ 0)
        assert -1e-6 < r["approx_kl"] < 1e-3
    assert records[1]["kl"] > 0  # the adapter moved away from the reference after one update
    assert (run_dir / "config.yaml").is_file()
    step1 = [json.loads(x) for x in (run_dir / "rollouts" / "step-1.jsonl").read_text().splitlines()]
    assert len(step1) == 4 and {"reward", "segments", "stats", "advantage"} <= step1[0].keys()
    assert sum(t["advantage"] for t in step1) == pytest.approx(0.0, abs=1e-5)  # one group, normalised
    tables = list((run_dir / "wandb").glob("offline-run-*/files/media/table/rollout/trajectories_*.table.json"))
    assert len(tables) == 2  # one trajectory table per step, offline
    table = json.loads(tables[0].read_text())
    assert "transcript" in table["columns"] and table["data"]
    assert {p.name for p in (run_dir / "plots").glob("*.png")} >= {"reward.png", "kl.png", "clip.png"}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert adapter(run_dir, 1).keys() == adapter(run_dir, 2).keys()
    assert any(not torch.equal(adapter(run_dir, 1)[k], adapter(run_dir, 2)[k]) for k in adapter(run_dir, 1))

    # The checkpoint alone rebuilds the trained policy (its base is the starting model).
    from common.config import ModelConfig
    from modeling.load import load_policy

    model, _ = load_policy(ModelConfig(name=str(run_dir / "checkpoints" / "step-2"), device="cpu"))
    start, _ = load_policy(ModelConfig(name=tiny_eos_model, device="cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    assert not torch.allclose(model(ids).logits, start(ids).logits)


@pytest.fixture(scope="module")
def straight_run(tiny_eos_model, tmp_path_factory, alfworld_data):
    """4 GRPO steps never stopped (checkpoints at 2 and 4): what a stopped and resumed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALFWORLD_DATA", str(alfworld_data))
        assert run(overrides(tiny_eos_model, run_dir, **{"train.save_steps": 2})) == 0
    return run_dir


def assert_same_run(resumed, straight) -> None:
    a, b = adapter(straight, 4), adapter(resumed, 4)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(adapter(straight, 2)[k], a[k]) for k in a)  # steps 3-4 did train
    lines = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    ref = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in lines] == pytest.approx([r["reward_mean"] for r in ref])


def test_resume_continues_the_same_run(tiny_eos_model, straight_run, tmp_path, alfworld_data, monkeypatch, capsys):
    """A run that gets a SIGTERM (a preemption notice) during step 2's update saves there although save_steps is
    4 and exits 75; `--resume` continues it to the weights, metrics and rewards of a run that was never stopped."""
    from training.trainer import Trainer

    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    resumed = tmp_path / "resumed"
    update = Trainer.update

    def term_in_step_2(self, samples, metrics):
        if metrics["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return update(self, samples, metrics)

    monkeypatch.setattr(Trainer, "update", term_in_step_2)
    capsys.readouterr()
    assert run(overrides(tiny_eos_model, resumed, **{"train.save_steps": 4})) == 75
    assert "stopped on a signal after step 2" in capsys.readouterr().err
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step-2"]
    monkeypatch.setattr(Trainer, "update", update)
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "succ')  # a crash mid-write of step 3's line
    assert run(["--resume", *overrides(tiny_eos_model, resumed, **{"train.save_steps": 4})]) == 0
    assert f"resuming {resumed} from {resumed / 'checkpoints' / 'step-2'} (step 2)" in capsys.readouterr().out
    assert_same_run(resumed, straight_run)


def test_a_stop_during_the_rollouts_keeps_them_for_the_resume(tiny_eos_model, straight_run, tmp_path, alfworld_data,
                                                              monkeypatch, capsys):
    """A SIGUSR1 during step 1's rollouts stops the run when they end, before the update: the rollouts are kept
    (training/pending.py) with a checkpoint of the starting weights (step 0). `--resume` trains step 1 on the
    kept rollouts without playing them again, to the run that was never stopped; its checkpoint drops them."""
    from training.trainer import Trainer

    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    resumed = tmp_path / "resumed"
    play_step, played = Trainer.play_step, []

    def usr1_in_step_1(self, step, *args):
        played.append(step)
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return play_step(self, step, *args)

    monkeypatch.setattr(Trainer, "play_step", usr1_in_step_1)
    capsys.readouterr()
    assert run(overrides(tiny_eos_model, resumed, **{"train.save_steps": 4})) == 75
    assert "after the rollouts of step 1" in capsys.readouterr().err
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step-0"]
    kept = resumed / "pending" / "step-1" / "rank-0.json"
    assert len(json.loads(kept.read_text())["trajectories"]) == 4
    assert not (resumed / "metrics.jsonl").is_file() or not (resumed / "metrics.jsonl").read_text().strip()

    played.clear()
    assert run(["--resume", *overrides(tiny_eos_model, resumed, **{"train.save_steps": 4})]) == 0
    out = capsys.readouterr().out
    assert f"from {resumed / 'checkpoints' / 'step-0'} (step 0)" in out and "training on the rollouts kept" in out
    assert played == [2, 3, 4]  # step 1 trained on the kept rollouts
    assert_same_run(resumed, straight_run)
    assert not (resumed / "pending" / "step-1").exists()


def test_full_finetuning_keeps_a_frozen_reference(tiny_eos_model, tmp_path, alfworld_data, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    from training.trainer import Trainer

    cfg = load_config("configs/tiny-cpu.yaml", overrides(tiny_eos_model, tmp_path / "full", **{
        "train.finetune": "full", "train.steps": 1}))
    trainer = Trainer(cfg)
    before = {k: v.detach().clone() for k, v in trainer.policy.model.state_dict().items()}
    trainer.train()
    after = trainer.policy.model.state_dict()
    ref = trainer.policy.reference_module().state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(before[k], ref[k]) for k in before)
    assert not any(p.requires_grad for p in trainer.policy.reference_module().parameters())
    assert (tmp_path / "full" / "checkpoints" / "step-1" / "model.safetensors").is_file()


def test_qlora_trains_an_adapter_on_a_4bit_base(tiny_eos_model, tmp_path, alfworld_data, monkeypatch):
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    run_dir = tmp_path / "qlora"
    assert run(overrides(tiny_eos_model, run_dir, **{"train.finetune": "qlora", "train.steps": 1})) == 0
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["num_updates"] == 1 and record["grad_norm"] > 0
    assert (run_dir / "checkpoints" / "step-1" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"train.global_batch_size": 3}, "must divide the rollout batch"),
        ({"train.group_size": 1, "train.global_batch_size": 1}, "group_size (G) must be >= 2"),
        ({"train.loss_agg": "sequence"}, "train.loss_agg"),
        ({"rollout.dtype": "bfloat16", "train.recompute_old_logprobs": False}, "train.recompute_old_logprobs=true"),
    ],
)
def test_bad_configs_stop_with_one_line(extra, message, tmp_path, capsys):
    assert run(overrides("tiny-qwen3-moe", tmp_path / "bad", **extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_resume_without_checkpoint_stops(tmp_path, capsys, alfworld_data, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    assert run(["--resume", *overrides("tiny-qwen3-moe", tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no checkpoint" in err
    assert run(["--resume-from", str(tmp_path / "nowhere"), *overrides("tiny-qwen3-moe", tmp_path / "e2")]) == 2
    assert "not a GRPO checkpoint" in capsys.readouterr().err


def test_int4_fake_quant_base_under_lora(tiny_eos_model, tmp_path, alfworld_data, monkeypatch):
    """Path A of the paper's INT4 setting: the frozen base holds its INT4 (RTN, group) values, LoRA trains."""
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    from modeling.quantize import fake_quant
    from training.trainer import Trainer

    cfg = load_config("configs/tiny-cpu.yaml", overrides(tiny_eos_model, tmp_path / "fq", **{
        "train.fake_quant_group_size": 32, "train.steps": 1}))
    trainer = Trainer(cfg)
    base = trainer.policy.model.get_base_model()
    q_proj = base.model.layers[0].self_attn.q_proj.base_layer.weight
    torch.testing.assert_close(q_proj, fake_quant(q_proj, 32), rtol=0, atol=1e-6)  # already on the INT4 grid
    groups = q_proj.detach().reshape(q_proj.shape[0], -1, 32)  # (out, in / 32, 32)
    assert max(len(torch.unique(g)) for g in groups.reshape(-1, 32)) <= 15  # q in [-7, 7]
    trainer.train()
    assert json.loads((tmp_path / "fq" / "metrics.jsonl").read_text().splitlines()[0])["num_updates"] == 1


def test_dynamic_sampling_draws_until_groups_carry_a_signal_or_the_bound(tiny_eos_model, tmp_path, alfworld_data,
                                                                         monkeypatch, caplog):
    """The release's dynamic sampling (train.tied_groups=resample): the never-ending tiny model ties every group,
    so each step draws 1 + max_sample_rounds groups and trains on none; the eos model's first group has a signal,
    from the penalties alone, which train.tied_on=task does not count."""
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    tied = tmp_path / "tied"
    assert run(overrides("tiny-qwen3-moe", tied, **{"train.steps": 1, "train.tied_groups": "resample",
                                                     "train.max_sample_rounds": 2})) == 0
    (record,) = [json.loads(x) for x in (tied / "metrics.jsonl").read_text().splitlines()]
    assert record["sample_rounds"] == 3 and record["groups_drawn"] == 3
    assert record["groups_dropped_by_sampling"] == 3 and record["num_samples"] == 0
    signal = tmp_path / "signal"
    assert run(overrides(tiny_eos_model, signal, **{"train.steps": 1, "train.tied_groups": "resample"})) == 0
    (record,) = [json.loads(x) for x in (signal / "metrics.jsonl").read_text().splitlines()]
    assert record["sample_rounds"] == 1 and record["groups_drawn"] == 1 and record["num_samples"] >= 4
    # that group's signal is the penalties alone (the tiny model solves no game): with train.tied_on=task it ties
    by_task = tmp_path / "by-task"
    caplog.set_level(logging.INFO, logger="training.trainer")
    assert run(overrides(tiny_eos_model, by_task, **{"train.steps": 1, "train.tied_groups": "resample",
                                                     "train.tied_on": "task", "train.max_sample_rounds": 1})) == 0
    (record,) = [json.loads(x) for x in (by_task / "metrics.jsonl").read_text().splitlines()]
    assert record["success_rate"] == 0.0 and record["sample_rounds"] == 2 and record["num_samples"] == 0
    assert "step 1, draw 2: 0 of the 2 groups drawn differ in R_task (train.tied_on=task), 1 wanted" in caplog.text


def test_segment_batches_count_segments_as_the_release_does(tiny_eos_model, tmp_path, alfworld_data, monkeypatch):
    """train.batch_unit=segments: global_batch_size counts segments; 4 trained segments in batches of 3 make 2
    optimizer steps (the last one takes the remainder), where trajectories would make 4 / 3: refused."""
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    run_dir = tmp_path / "segments"
    assert run(overrides(tiny_eos_model, run_dir, **{"train.steps": 1, "train.batch_unit": "segments",
                                                     "train.global_batch_size": 3, "train.loss_agg": "segment"})) == 0
    (record,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["num_samples"] == 4 and record["num_updates"] == 2
    assert run(overrides(tiny_eos_model, tmp_path / "t", **{"train.global_batch_size": 3})) == 2
