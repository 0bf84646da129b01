"""`memexrl train --dry-run` (memexrl/plan.py): batch arithmetic and memory estimate by hand."""

from __future__ import annotations

import pytest

from common.config import load_config
from common.errors import MemexError
from memexrl.cli import main
from memexrl.plan import (
    GIB,
    ModelNumbers,
    make_plan,
    memory_per_process,
    model_numbers,
    resolve_processes,
    resolve_zero_stage,
)


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in ("WORLD_SIZE", "ACCELERATE_NUM_PROCESSES", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(var, raising=False)


def test_processes_come_from_argument_then_env_then_accelerate_config():
    acc = {"num_processes": 8}
    assert resolve_processes(4, acc, {"WORLD_SIZE": "2"})[0] == 4
    assert resolve_processes(None, acc, {"WORLD_SIZE": "2"}) == (2, "$WORLD_SIZE")
    assert resolve_processes(None, acc, {"ACCELERATE_NUM_PROCESSES": "16"})[0] == 16
    assert resolve_processes(None, acc, {}) == (8, "accelerate config num_processes")
    assert resolve_processes(None, {}, {})[0] == 1


def test_zero_stage_from_the_accelerate_configs():
    from memexrl.plan import load_accelerate_config

    assert resolve_zero_stage(load_accelerate_config("configs/accelerate/zero2-8gpu.yaml"), {}) == (
        2, "configs/deepspeed/zero2.json")
    assert resolve_zero_stage(load_accelerate_config("configs/accelerate/zero3-8gpu.yaml"), {})[0] == 3
    assert resolve_zero_stage(load_accelerate_config("configs/accelerate/multinode-zero3.yaml"), {})[0] == 3
    assert resolve_zero_stage(load_accelerate_config("configs/accelerate/single.yaml"), {})[0] == -1
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "configs/deepspeed/zero3.json"}
    assert resolve_zero_stage({}, env)[0] == 3
    assert resolve_zero_stage({}, {})[0] == -1


def test_batch_arithmetic_of_the_paper_config():
    cfg = load_config("configs/paper-8gpu.yaml")
    plan = make_plan(cfg, 8, "test", zero_stage=3)
    assert plan.rollouts_per_step == 256 and plan.optimizer_steps_per_rollout_step == 2
    assert plan.tasks_per_process == 4 and plan.rollouts_per_process == 32
    assert plan.trajectories_per_optimizer_step_per_process == 16 and plan.total_optimizer_steps == 100
    assert plan.weight_bytes == 2  # bf16
    with pytest.raises(MemexError, match="multiples of the 3 processes"):
        make_plan(cfg, 3, "test")


def test_memory_estimate_by_hand():
    n = ModelNumbers(total=1000, linear=600, lora=10, source="test")
    # full, bf16, ZeRO-3 over 4: everything sharded; DeepSpeed Adam = 2 fp32 moments + fp32 master (12 B)
    assert memory_per_process(n, "full", 2, 3, 4) == {
        "weights": 500, "reference": 500, "gradients": 500, "optimizer": 3000, "total": 4500}
    # full, fp32, no DeepSpeed: torch AdamW moments in the weights' dtype
    assert memory_per_process(n, "full", 4, -1, 1) == {
        "weights": 4000, "reference": 4000, "gradients": 4000, "optimizer": 8000, "total": 20000}
    # ZeRO-2 over 2: weights and reference whole, gradients and states halved
    assert memory_per_process(n, "full", 2, 2, 2)["gradients"] == 1000
    assert memory_per_process(n, "full", 2, 2, 2)["weights"] == 2000
    # LoRA, ZeRO-2 over 2: base weights + fp32 adapter; only the adapter has gradients and states
    assert memory_per_process(n, "lora", 2, 2, 2) == {
        "weights": 2040, "reference": 0, "gradients": 20, "optimizer": 40, "total": 2100}
    # QLoRA: Linear weights in 4 bits, the rest in the dtype
    assert memory_per_process(n, "qlora", 2, -1, 1)["weights"] == 0.5 * 600 + 2 * 400 + 40


def test_parameter_count_of_qwen3_30b_a3b_without_weights():
    cfg = load_config("configs/paper-8gpu.yaml", ["train.finetune=lora"])
    n = model_numbers(cfg)
    assert n.total == 30_532_122_624  # 30.5B, the model card's total
    # LoRA r=16 on q/k/v/o of 48 layers (train.lora_target_modules=auto on an MoE model: attention only)
    assert n.lora == 48 * 16 * (2 * (2048 + 4096) + 2 * (2048 + 512))
    assert model_numbers(cfg, params=123).total == 123


def test_dry_run_cli_for_the_paper_config(capsys):
    assert main(["train", "--config", "configs/paper-8gpu.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "256 = 32 tasks x G 8" in out and "2 per rollout step" in out
    assert "finetune full" in out and "T = 8000" in out and "lr 5e-06" in out and "GiB" in out
    assert main(["train", "--config", "configs/paper-8gpu.yaml", "--dry-run",
                 "--accelerate-config", "configs/accelerate/zero3-8gpu.yaml"]) == 0
    out = capsys.readouterr().out
    assert "8 [accelerate config num_processes], DeepSpeed ZeRO-3" in out and "per process 4 tasks = 32 rollouts" in out
    total = 30_532_122_624
    expected = (2 * total / 8) * 3 + 12 * total / 8  # weights, reference, gradients + Adam, sharded over 8
    assert f"~{expected / GIB:.1f} GiB" in out


def test_dry_run_needs_a_parameter_count_for_an_unknown_model(capsys):
    args = ["train", "--config", "configs/paper-8gpu.yaml", "--dry-run", "model.name=nobody/unknown-model"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--params" in err
    assert main([*args[:4], "--params", "7000000000", *args[4:]]) == 0
    assert "7.00B total" in capsys.readouterr().out


def test_activations_by_hand():
    from memexrl.gpu_budget import Architecture, activation_bytes

    arch = Architecture(layers=4, hidden=100, vocab=1000, kv_bytes_per_token=64, int4_bytes=0, bf16_bytes=0)
    cfg = load_config("configs/paper-8gpu.yaml", ["memory.threshold=900", "rollout.max_new_tokens=100",
                                                  "train.micro_batch_size=2", "train.head_chunk_size=0"])
    tokens = 2 * 1000  # 2 segments of T + one turn
    layer = 34 * tokens * 100  # one layer's working set, 2-byte activations (Korthikanti et al. 2022)
    logits = 3 * 4 * 1000 * tokens  # fp32 logits, log-softmax and its gradient over every position
    assert activation_bytes(cfg, arch, 2) == 4 * tokens * 100 * 2 + layer + logits  # checkpointed layer inputs
    chunked = load_config("configs/paper-8gpu.yaml", ["memory.threshold=900", "rollout.max_new_tokens=100",
                                                      "train.micro_batch_size=2", "train.head_chunk_size=50"])
    assert activation_bytes(chunked, arch, 2) == 4 * tokens * 100 * 2 + layer + 3 * 4 * 1000 * 100
    no_ckpt = load_config("configs/paper-8gpu.yaml", ["memory.threshold=900", "rollout.max_new_tokens=100",
                                                      "train.micro_batch_size=2", "train.head_chunk_size=0",
                                                      "train.gradient_checkpointing=false"])
    assert activation_bytes(no_ckpt, arch, 2) == 4 * layer + logits


FULL_INT4 = ["train.fake_quant_group_size=128", "rollout.engine=vllm", "rollout.vllm_model=runs/int4",
             "rollout.vllm_gpu_memory_utilization=0.35"]


def dry_run_of(capsys, accelerate: str, gpu: float, *overrides: str, config: str = "configs/paper-8gpu.yaml",
               force: bool = False) -> tuple[int, str, str]:
    args = ["train", "--config", config, "--dry-run", "--gpu-memory-gib", str(gpu), *(["--force"] if force else [])]
    if accelerate:
        args += ["--accelerate-config", f"configs/accelerate/{accelerate}"]
    code = main([*args, *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_plan_that_does_not_fit_says_what_would_and_exits_non_zero(capsys):
    # The README's old ZeRO-2 full fine-tuning: 163.5 GiB of state per process, and the transformers engine's KV.
    code, out, err = dry_run_of(capsys, "zero2-8gpu.yaml", 141)
    assert code == 2 and "~163.5 GiB per process" in out and "DOES NOT FIT" in out
    assert "INT4 rollouts in a colocated vLLM under ZeRO-3" in out and "--force" in err
    assert dry_run_of(capsys, "zero2-8gpu.yaml", 141, force=True)[0] == 0
    # The release's setting (full fine-tuning, INT4 fake-quant, colocated INT4 vLLM) on 8 x 141 GB and 8 x 80 GB.
    code, out, _ = dry_run_of(capsys, "zero3-8gpu.yaml", 141, *FULL_INT4)
    assert code == 0 and "fits: peak" in out and "vLLM 49.3" in out  # 0.35 x 141 GiB
    code, out, _ = dry_run_of(capsys, "zero3-8gpu.yaml", 80, *FULL_INT4)
    assert code == 2 and "offload the optimizer states" in out and "LoRA on the frozen base" in out
    code, out, _ = dry_run_of(capsys, "zero3-offload-8gpu.yaml", 80, *FULL_INT4)
    assert code == 0 and "offloaded to host memory: optimizer" in out and "42.7 GiB per process of offloaded" in out


def test_vllm_needs_room_for_its_weights_and_one_window(capsys):
    # INT4 Qwen3-30B-A3B: 15.5 GiB of weights + 32768 tokens x 96 KiB of KV cache = 18.6 GiB.
    code, out, _ = dry_run_of(capsys, "", 141, "rollout.vllm_gpu_memory_utilization=0.1", config="configs/h200-lora.yaml")
    assert code == 2 and "cannot hold its weights and one window of KV (18.6 GiB)" in out
    assert dry_run_of(capsys, "", 141, config="configs/h200-lora.yaml")[0] == 0  # the recipe fits one H200
    assert dry_run_of(capsys, "", 141, config="configs/h200-reading.yaml")[0] == 0  # and its reading run


def test_no_gpu_no_fit_check(capsys):
    assert main(["train", "--config", "configs/h200-lora.yaml", "--dry-run"]) == 0
    assert "not checked: no GPU visible; pass --gpu-memory-gib" in capsys.readouterr().out
