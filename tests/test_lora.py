"""LoRA targets per architecture (modeling/lora.py): what vLLM can serve, and the dry-run's count is the built one's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from common.config import load_config
from common.errors import MemexError
from memexrl.plan import KNOWN_ARCHITECTURES, model_numbers
from modeling import zoo as model_zoo
from modeling.lora import auto_targets, unservable_adapters
from training.policy import load_policy_for_grpo


def tiny_moe_config(**train) -> list[str]:
    return [f"model.name={model_zoo.TINY_MOE_ALIAS}", "model.device=cpu", "train.init_checkpoint=",
            "train.finetune=lora", *(f"train.{k}={v}" for k, v in train.items())]


def meta_model(name: str):
    values = dict(KNOWN_ARCHITECTURES[name][0])
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))


def test_auto_targets_per_architecture():
    assert auto_targets(meta_model("Qwen/Qwen3-30B-A3B")) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # MoE: attention
    assert auto_targets(meta_model("HuggingFaceTB/SmolLM2-135M-Instruct")) == [  # dense: every decoder linear
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("targets", ["auto", "all-linear", "q_proj,v_proj"])
def test_dry_run_counts_the_adapter_the_trainer_builds(targets):
    cfg = load_config("configs/tiny-cpu.yaml", tiny_moe_config(lora_target_modules=targets))
    policy = load_policy_for_grpo(cfg)
    built = sum(p.numel() for p in policy.trainable_parameters())
    assert model_numbers(cfg).lora == built
    wrapped = unservable_adapters(policy.model)
    if targets == "all-linear":  # PEFT's all-linear also wraps the router and the fused experts
        assert any(name.endswith("mlp.gate") for name in wrapped) and any("experts" in name for name in wrapped)
    else:
        assert wrapped == []


def test_the_default_lora_on_moe_is_servable_by_vllm():
    cfg = load_config("configs/tiny-cpu.yaml", tiny_moe_config())
    assert cfg.train.lora_target_modules == "auto" and cfg.sft.lora_target_modules == "auto"
    policy = load_policy_for_grpo(cfg)
    assert unservable_adapters(policy.model) == []
    names = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert names and all(".self_attn." in n for n in names)


def test_vllm_rollouts_refuse_an_adapter_vllm_cannot_serve():
    cfg = load_config("configs/tiny-cpu.yaml", [*tiny_moe_config(lora_target_modules="all-linear"),
                                                "rollout.engine=vllm"])
    with pytest.raises(MemexError, match="router or expert modules .* vLLM cannot serve"):
        load_policy_for_grpo(cfg)
