"""The trainable policy and its reference for GRPO: full fine-tuning, LoRA or QLoRA.

memex.md "Training": KL to the reference policy, which is the policy RL starts from (the SFT
warm start). How the reference is kept depends on what is trained:
  - full: a frozen copy of the starting weights (the release trains all weights);
  - lora / qlora: a fresh LoRA adapter on the starting weights; the reference is the same
    module with the adapter disabled, so it costs no memory. An SFT LoRA checkpoint is merged
    into its base first, so "adapter disabled" is the SFT policy, not the raw base.
QLoRA loads the base in 4-bit NF4 through bitsandbytes (it needs a full checkpoint: a 4-bit
base cannot take a merged adapter).

Under DeepSpeed ZeRO-3 the frozen reference copy (full fine-tuning) is sharded like the policy,
as an inference-only DeepSpeed engine (`Policy.shard_reference`, TRL's `prepare_deepspeed`); under
ZeRO-2 it stays whole on each process, in the policy's dtype. With `zero3_init_flag` the policy is
built already sharded, so the reference is loaded a second time instead of deep-copied.

A GRPO LoRA checkpoint records the starting checkpoint as its base
(`base_model_name_or_path`), so `modeling.load.load_policy` rebuilds the trained policy from
it alone: SFT adapter merged, then the RL adapter merged.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from pathlib import Path

import torch

from common.config import Config
from common.errors import MemexError
from modeling.load import adapter_base, load_policy
from modeling.lora import lora_config, unservable_adapters
from modeling.quantize import apply_fake_quant, remove_fake_quant
from training.state import newest_checkpoint


class Policy:
    """The trained module, its tokenizer, and how to get log-probs of the reference policy."""

    def __init__(self, model, tokenizer, finetune: str, init_source: str, reference=None, fake_quant: int = 0):
        self.model = model
        self.fake_quant = fake_quant  # group size of the INT4 fake-quant parametrizations (full fine-tuning)
        self.rollout_model_dir = init_source
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

    def save(self, directory: Path, state_dict: dict | None = None) -> None:
        """HF format: the adapter (with the starting checkpoint as its base) or the full model.

        `state_dict`: the weights to write when the module's own are sharded (DeepSpeed ZeRO-3:
        `accelerator.get_state_dict` of the engine); PEFT keeps only the adapter's entries of it.
        """
        if self.uses_adapter:
            for peft_config in self.model.peft_config.values():
                peft_config.base_model_name_or_path = self.init_source
        if self.fake_quant and state_dict is None:
            remove_fake_quant(self.model)  # save the full-precision weights under their own names
            self.model.save_pretrained(directory)
            apply_fake_quant(self.model, self.fake_quant)
        else:
            self.model.save_pretrained(directory, state_dict=state_dict)
        self.tokenizer.save_pretrained(directory)

    def shard_reference(self, accelerator) -> None:
        """ZeRO-3: shard the frozen reference copy (full fine-tuning) like the policy, for inference only."""
        if self._reference is not None:
            from trl.models import prepare_deepspeed

            self._reference = prepare_deepspeed(self._reference, accelerator)


def require_fake_quant(model, group_size: int, what: str) -> list[str]:
    """`apply_fake_quant`, where covering no weight is an error: the run would train without the INT4
    weights its rollout engine uses while the config says it does (train.fake_quant_group_size)."""
    names = apply_fake_quant(model, group_size)
    if not names:
        raise MemexError(
            f"train.fake_quant_group_size={group_size} fake-quantises no weight of {what}: no decoder "
            f"linear or expert weight has an input size that {group_size} divides (or the weights were not "
            f"found); pick a group size that divides hidden_size, or set train.fake_quant_group_size=0")
    return names


def init_source(cfg: Config) -> str:
    """Where RL starts: train.init_checkpoint (a checkpoint, or a run dir: its newest one) or model.name."""
    src = cfg.train.init_checkpoint or cfg.model.name
    path = Path(src).expanduser()
    if cfg.train.init_checkpoint and not path.exists():
        raise MemexError(f"train.init_checkpoint {src} does not exist; point it at the SFT run directory "
                         f"(e.g. runs/sft) or one of its checkpoints/step-N")
    return resolve_checkpoint(src, "train.init_checkpoint")


def resolve_checkpoint(src: str, setting: str) -> str:
    """A checkpoint directory, a run directory (its newest checkpoint) or a model name, as `load_policy` takes it."""
    path = Path(src).expanduser()
    if (path / "checkpoints").is_dir():
        newest = newest_checkpoint(path)
        if newest is None:
            raise MemexError(f"{setting} {src} is a run directory without checkpoints")
        path = newest
    return str(path.resolve()) if path.exists() else src


def load_policy_for_grpo(cfg: Config, resume_from: Path | None = None, export_base: Path | None = None) -> Policy:
    """Build the trainable policy (and its reference) as train.finetune says.

    `resume_from` is a GRPO checkpoint directory whose trained weights replace the start's:
    the adapter for lora/qlora, the whole model for full fine-tuning (the reference stays the
    starting checkpoint either way). `export_base`: where to write the merged start when it is
    an adapter checkpoint, for an external engine that loads weights from disk (vLLM);
    `Policy.rollout_model_dir` says which directory holds the starting weights.
    With train.fake_quant_group_size > 0 the forward uses INT4 fake-quant base weights
    (modeling/quantize.py), the reference too: trainer and INT4 rollout engine see the same weights.
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
    rollout_dir = source
    if adapter_base(source) is not None and export_base is not None and finetune != "qlora":
        model.save_pretrained(export_base)
        tokenizer.save_pretrained(export_base)
        rollout_dir = str(export_base)
    group = cfg.train.fake_quant_group_size
    if finetune == "full":
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():  # zero3_init_flag: sharded weights, a deep copy would copy empty shards
            reference = load_policy(replace(cfg.model, name=source))[0]
        else:
            reference = copy.deepcopy(model)
        reference.eval().requires_grad_(False)
        if resume_from is not None:
            model, _ = load_policy(replace(cfg.model, name=str(resume_from)))
        model.requires_grad_(True)
        if group:
            require_fake_quant(reference, group, "the reference")  # frozen: replaced once by its INT4 values
            require_fake_quant(model, group, "the policy")  # trainable: a parametrization, straight-through gradients
        policy = Policy(model, tokenizer, finetune, source, reference, fake_quant=group)
    else:
        t = cfg.train
        model = get_peft_model(model, lora_config(model, t.lora_r, t.lora_alpha, 0.0, t.lora_target_modules))
        unservable = unservable_adapters(model)
        if unservable and cfg.rollout.engine == "vllm":
            raise MemexError(
                f"train.lora_target_modules={t.lora_target_modules} puts LoRA adapters on {len(unservable)} router or "
                f"expert modules (e.g. {unservable[0]}), which vLLM cannot serve: use train.lora_target_modules=auto "
                f"(modeling/lora.py) or name the attention projections")
        if resume_from is not None:
            adapter = resume_from / "adapter_model.safetensors"
            try:
                set_peft_model_state_dict(model, load_file(str(adapter)))
            except Exception as exc:  # safetensors' error for a cut or garbled file, OSError for a missing one
                raise MemexError(f"checkpoint {resume_from}: its adapter {adapter.name} does not load ({exc}); "
                                 f"resume from another checkpoint (--resume-from)") from None
        if group:
            require_fake_quant(model, group, "the LoRA base")  # frozen; LoRA adds its delta outside it (path A)
        policy = Policy(model, tokenizer, finetune, source)
    policy.rollout_model_dir = rollout_dir
    if cfg.train.gradient_checkpointing:
        policy.model.gradient_checkpointing_enable()
    policy.model.train()
    return policy
