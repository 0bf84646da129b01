"""Which modules get LoRA adapters (`train.lora_target_modules`, `sft.lora_target_modules`), and their size.

The default, ``auto``, is decided per architecture from the model itself, and only ever names modules
that vLLM serves LoRA adapters on, since the GRPO adapter is synced to vLLM after every update
(rollout/vllm.py) and an adapter vLLM cannot load would stop the first launch:
  - a dense model: every ``nn.Linear`` of the decoder layers (attention and MLP projections);
  - a mixture-of-experts model (a layer whose MLP holds ``experts``): the attention projections only.
    PEFT's ``all-linear`` would also wrap the router (``mlp.gate``, a linear layer in transformers 4.x
    and 5.x) and, with PEFT >= 0.18 on transformers 5's fused experts, the experts' 3-D weights: on
    Qwen3-30B-A3B that is 996.5M trained parameters (r 16) instead of 13.4M, none of which vLLM can
    serve (it never serves router adapters; its MoE LoRA expects per-expert weights).
Routers (``gate``, ``router``, ``shared_expert_gate``) and the output layer are never chosen by ``auto``.
``all-linear`` and explicit comma-separated names stay available and mean what PEFT says they mean.

`count_lora_parameters` builds the adapter with PEFT on the meta device, so the count that
`memexrl train --dry-run` prints is the built model's by construction, for any architecture.
"""

from __future__ import annotations

import re

import torch

from common.errors import MemexError

AUTO = "auto"
_ROUTER = re.compile(r"(^|\.)(gate|router|shared_expert_gate)$")
# Module names vLLM never serves a LoRA adapter on (the adapter sync would fail on them).
_UNSERVABLE = re.compile(r"(^|\.)(gate|router|shared_expert_gate|experts)(\.|$)")


def is_moe_layer_mlp(module: torch.nn.Module) -> bool:
    return hasattr(module, "experts")


def auto_targets(model: torch.nn.Module) -> list[str]:
    """The ``auto`` module names of `model` (the module docstring's rule), sorted."""
    moe_prefixes = tuple(f"{name}." for name, m in model.named_modules() if ".layers." in name and is_moe_layer_mlp(m))
    names = set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".layers." not in name or _ROUTER.search(name):
            continue
        if moe_prefixes and name.startswith(moe_prefixes):
            continue
        names.add(name.rsplit(".", 1)[-1])
    if not names:
        raise MemexError(f"lora_target_modules=auto found no linear layer in the decoder layers of "
                         f"{type(model).__name__}: name the modules (comma-separated) or use all-linear")
    return sorted(names)


def resolve_targets(model: torch.nn.Module, spec: str) -> str | list[str]:
    """What PEFT's ``target_modules`` gets: ``auto`` resolved on `model`, ``all-linear``, or the listed names."""
    spec = spec.strip()
    if spec == AUTO:
        return auto_targets(model)
    if spec == "all-linear":
        return spec
    return [t.strip() for t in spec.split(",") if t.strip()]


def lora_config(model: torch.nn.Module, r: int, alpha: int, dropout: float, target_modules: str):
    """A PEFT LoraConfig for a causal LM, its targets resolved on `model` (`resolve_targets`)."""
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=resolve_targets(model, target_modules),
                      task_type="CAUSAL_LM")


def unservable_adapters(peft_model: torch.nn.Module) -> list[str]:
    """Modules of a PEFT model whose adapter vLLM cannot serve (router, experts): empty when all can be."""
    return sorted({name.split(".lora_")[0] for name, _ in peft_model.named_parameters()
                   if ".lora_" in name and _UNSERVABLE.search(name.split(".lora_")[0])})


def count_lora_parameters(model: torch.nn.Module, r: int, alpha: int, target_modules: str) -> int:
    """Trainable parameters of the LoRA adapter PEFT builds on `model` (a meta-device model: nothing is allocated)."""
    from peft import get_peft_model

    with torch.device("meta"):
        peft_model = get_peft_model(model, lora_config(model, r, alpha, 0.0, target_modules))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
