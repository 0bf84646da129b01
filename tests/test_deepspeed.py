"""The GRPO trainer under `accelerate launch` with DeepSpeed ZeRO-2 and ZeRO-3, in one CPU process.

DeepSpeed runs on the CPU with the gloo backend; the 8-GPU accelerate configs are used as they
are, with `--num_processes 1`. The run is the tiny one of tests/test_trainer.py (the tiny
Qwen3-MoE with a random end-of-turn row, 1 game x G 4, 3 env steps), with one segment per
micro-batch so that DeepSpeed accumulates over several: two steps, then a resume. The first
update must equal the plain (non-DeepSpeed) path's: same rollouts, one optimizer step per
minibatch, the same clipping.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import REPO, accelerate_launch, rank_env
from test_trainer import adapter, overrides

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow


def launch(config: str | None, args: list[str], alfworld_data) -> subprocess.CompletedProcess:
    """`accelerate launch` with configs/accelerate/CONFIG in one process, or the plain CLI when None."""
    program = ["-m", "memexrl.cli", "train", "--config", "configs/tiny-cpu.yaml", *args]
    cmd = accelerate_launch(config, 1, program) if config else [sys.executable, *program]
    return subprocess.run(cmd, cwd=REPO, env=rank_env(ALFWORLD_DATA=str(alfworld_data)), capture_output=True,
                          text=True, timeout=900)


def args_for(model: str, run_dir: Path, steps: int) -> list[str]:
    return overrides(model, run_dir, **{"train.steps": steps, "train.save_steps": 1, "train.wandb": False,
                                        "train.micro_batch_size": 1})


@pytest.fixture(scope="module")
def plain_run(tiny_eos_model, alfworld_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    done = launch(None, args_for(tiny_eos_model, run_dir, 1), alfworld_data)
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


@pytest.mark.parametrize("config", ["zero2-8gpu.yaml", "zero3-8gpu.yaml"])
def test_two_steps_and_resume_under_deepspeed(config, tiny_eos_model, tmp_path, alfworld_data, plain_run):
    run_dir = tmp_path / "run"
    done = launch(config, args_for(tiny_eos_model, run_dir, 2), alfworld_data)
    assert done.returncode == 0, done.stderr[-4000:]
    first = json.loads((plain_run / "metrics.jsonl").read_text().splitlines()[0])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["num_updates"] == 1 and r["grad_norm"] > 0  # the norm DeepSpeed's engine computed at its step
    assert records[0]["num_samples"] > 1  # several micro-batches accumulated into the one optimizer step
    assert records[0]["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5)
    ours, plain = adapter(run_dir, 1), adapter(plain_run, 1)
    assert ours.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-4, atol=1e-6)
    step2 = run_dir / "checkpoints" / "step-2"
    assert (step2 / "adapter_model.safetensors").is_file() and (step2 / "trainer_state.json").is_file()
    assert (step2 / "deepspeed" / "state").is_dir() and not (step2 / "optimizer.pt").exists()
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))

    resumed = launch(config, ["--resume", *args_for(tiny_eos_model, run_dir, 3)], alfworld_data)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "step-3" / "adapter_model.safetensors").is_file()

