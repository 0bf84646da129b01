"""The trainable policy and its reference for GRPO: full fine-tuning, LoRA or QLoRA.

memex.md "Training": KL to the reference policy, which is the policy RL starts from (the SFT
warm start). How the reference is kept depends on what is trained:
  - full: a frozen copy of the starting weights (the release trains all weights);
  - lora / qlora: a fresh LoRA adapter on the starting weights; the reference is the same
    module with the adapter disabled, so it costs no memory. An SFT LoRA checkpoint is merged
    into its base first, so "adapter disabled" is the SFT policy, not the raw base.
QLoRA loads the base in 4-bit NF4 through bitsandbytes (it needs a full checkpoint: a 4-bit
base cannot take a merged adapter).

A GRPO LoRA checkpoint records the starting checkpoint as its base
(`base_model_name_or_path`), so `memexrl.models.load_policy` rebuilds the trained policy from
it alone: SFT adapter merged, then the RL adapter merged.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from pathlib import Path

import torch

from memexrl.config import Config
from memexrl.errors import MemexError
from memexrl.models import load_policy
from memexrl.train_state import newest_checkpoint


class Policy:
    """The trained module, its tokenizer, and how to get log-probs of the reference policy."""

    def __init__(self, model, tokenizer, finetune: str, init_source: str, reference=None):
        self.model = model
        self.tokenizer = tokenizer
        self.finetune = finetune
        self.init_source = init_source
        self._reference = reference  # a frozen copy (full fine-tuning) or None (adapter disabled)

    @property
    def uses_adapter(self) -> bool:
        return self.finetune in ("lora", "qlora")

    def reference_context(self):
        """Context manager under which `reference_module()` computes the reference policy."""
        if self.uses_adapter:
            return self.model.disable_adapter()
        return contextlib.nullcontext()

    def reference_module(self):
        return self.model if self.uses_adapter else self._reference

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def save(self, directory: Path) -> None:
        """HF format: the adapter (with the starting checkpoint as its base) or the full model."""
        if self.uses_adapter:
            for peft_config in self.model.peft_config.values():
                peft_config.base_model_name_or_path = self.init_source
        self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)


def _lora_config(cfg: Config):
    from peft import LoraConfig

    t = cfg.train
    targets = t.lora_target_modules if t.lora_target_modules == "all-linear" else t.lora_target_modules.split(",")
    return LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")


def init_source(cfg: Config) -> str:
    """Where RL starts: train.init_checkpoint (a checkpoint, or a run dir: its newest one) or model.name."""
    src = cfg.train.init_checkpoint or cfg.model.name
    path = Path(src).expanduser()
    if cfg.train.init_checkpoint and not path.exists():
        raise MemexError(f"train.init_checkpoint {src} does not exist; point it at the SFT run directory "
                         f"(e.g. runs/sft) or one of its checkpoints/step-N")
    if (path / "checkpoints").is_dir():
        newest = newest_checkpoint(path)
        if newest is None:
            raise MemexError(f"train.init_checkpoint {src} is a run directory without checkpoints")
        path = newest
    return str(path.resolve()) if path.exists() else src


def load_policy_for_grpo(cfg: Config, resume_from: Path | None = None) -> Policy:
    """Build the trainable policy (and its reference) as train.finetune says.

    `resume_from` is a GRPO checkpoint directory whose trained weights replace the start's:
    the adapter for lora/qlora, the whole model for full fine-tuning (the reference stays the
    starting checkpoint either way).
    """
    from peft import get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    finetune = cfg.train.finetune
    source = init_source(cfg)
    if finetune == "qlora":
        model, tokenizer = load_policy(replace(cfg.model, name=source), for_training=True, quantization="4bit")
    else:
        # for_training=False merges an SFT adapter into its base: the start is one plain model.
        model, tokenizer = load_policy(replace(cfg.model, name=source))
    if finetune == "full":
        reference = copy.deepcopy(model).eval().requires_grad_(False)
        if resume_from is not None:
            model, _ = load_policy(replace(cfg.model, name=str(resume_from)))
        model.requires_grad_(True)
        policy = Policy(model, tokenizer, finetune, source, reference)
    else:
        model = get_peft_model(model, _lora_config(cfg))
        if resume_from is not None:
            set_peft_model_state_dict(model, load_file(str(resume_from / "adapter_model.safetensors")))
        policy = Policy(model, tokenizer, finetune, source)
    if cfg.train.gradient_checkpointing:
        policy.model.gradient_checkpointing_enable()
    policy.model.train()
    return policy
