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


def assert_server_stopped(log: str) -> None:
    """The server whose log this is answers no more (it was stopped at the end of the run)."""
    port = next(line for line in log.splitlines() if "127.0.0.1:" in line)
    url = "http://127.0.0.1:" + port.split("127.0.0.1:")[1].split()[0].strip("/ ")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


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
    assert_server_stopped(log)
    assert os.path.isdir(run_dir / "checkpoints" / "step-2")


def strong_adapter(directory: Path) -> str:
    """A LoRA adapter on SmolLM2 whose B matrices are random (not PEFT's zeros): it changes what the model says."""
    import torch
    from peft import LoraConfig, get_peft_model

    from common.config import ModelConfig
    from modeling.load import load_policy

    model, tokenizer = load_policy(ModelConfig(name="smollm2-135m", device="cpu"))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_eval_plays_a_lora_checkpoint_through_a_managed_vllm_cpu_server(tmp_path, alfworld_data, monkeypatch):
    """`memexrl eval alfworld` with rollout.vllm_server_url=managed serves the merged checkpoint (not its base),
    greedy, and stops the server at the end: its first reply is the transformers engine's (float32 both)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = strong_adapter(tmp_path / "adapter")
    common = ["--split", "valid_seen", "--games", "1", f"env.data_dir={alfworld_data}", "env.max_steps=2",
              "env.num_workers=1", "rollout.max_new_tokens=24", "rollout.max_context_tokens=2048", "model.device=cpu"]

    def first_reply(checkpoint: str, name: str, *engine: str) -> str:
        out = tmp_path / name
        assert main(["eval", "alfworld", "--checkpoint", checkpoint, "--out", str(out), *common, *engine]) == 0
        result = json.loads((out / "eval_alfworld.json").read_text())
        assert result["n_games"] == 1 and result["n_crashed"] == 0
        return json.loads((out / "episodes.jsonl").read_text().splitlines()[0])["steps"][0]["assistant"]

    served = first_reply(adapter, "vllm", "rollout.engine=vllm", "rollout.vllm_server_url=managed",
                         f"rollout.vllm_server_python={VLLM_PYTHON}")
    assert served == first_reply(adapter, "transformers")
    assert served != first_reply("smollm2-135m", "base")  # the adapter's weights were served, not the base's
    log = (tmp_path / "vllm" / "vllm-serve.log").read_text()
    assert str(tmp_path / "vllm" / "merged") in log and "dtype=torch.float32" in log
    assert_server_stopped(log)


def test_episodes_in_flight_on_a_vllm_server_play_the_turns_of_the_rounds(tmp_path, alfworld_data, monkeypatch):
    """Sampled episodes through one managed vLLM CPU server, each turn sent as soon as its episode is ready
    (rollout.lockstep_turns false, the default) and a round at a time (true): every reply is the same, since each
    turn's sampling seed is its episode's and turn's, whatever else the server is batching."""
    from common.config import load_config
    from envs.data import resolve_game
    from modeling.zoo import resolve_model_path
    from rollout.runner import make_renderer, open_envs, run_episodes
    from rollout.vllm import make_vllm_engine
    from rollout.vllm_server import ManagedServer

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(None, [f"env.data_dir={alfworld_data}", "env.max_steps=3", "rollout.max_new_tokens=24",
                             "rollout.temperature=1.0", "rollout.max_context_tokens=2048"])
    model_dir = str(resolve_model_path("smollm2-135m", cfg.model.cache_dir))
    jobs = [(f"e{i}", str(resolve_game(f"valid_seen:{i}", alfworld_data))) for i in range(3)]
    replies = {}
    with ManagedServer.serving(str(VLLM_PYTHON), model_dir, tmp_path / "vllm-serve.log", dtype="float32",
                               max_model_len=2048, lora_rank=0) as server:
        from modeling.load import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        for lockstep in (True, False):
            cfg.rollout.lockstep_turns = lockstep
            engine = make_vllm_engine(model_dir=model_dir, tokenizer=tokenizer, sampling=cfg.rollout, seed=7,
                                      dtype="float32", **server.engine_args())
            assert engine.concurrent
            with open_envs(cfg, 1) as envs:
                trajs = run_episodes(jobs, engine, envs, make_renderer(tokenizer, cfg), cfg)
            replies[lockstep] = [[s.assistant for s in t.steps] for t in trajs]
            counted = engine.counters()  # the server's own totals, read from its /metrics
            assert counted["generated_tokens"] > 0 and counted["prompt_tokens"] > counted["generated_tokens"]
    assert sum(map(len, replies[True])) >= 6 and not any(t.crashed for t in trajs)
    assert replies[True] == replies[False]
