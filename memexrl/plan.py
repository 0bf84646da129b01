"""`memexrl train --dry-run`: the resolved plan of a GRPO run, without loading the model or a GPU.

Pure functions over the config: how many processes and where that number comes from, the
batch arithmetic of memexrl/trainer.py (rollouts per step, each process's share, optimizer
steps per rollout step), and a rough memory estimate per process: weights, gradients and Adam
states, sharded by the ZeRO stage of the DeepSpeed config if one is used, LoRA counting only the
adapter's gradients and states. Activations, the KV cache and the rollout engine's own memory
are not counted.

The parameter count comes from the model's config.json, instantiated on the meta device (no
weights): a local directory, the HF cache (offline, `local_files_only`), or else the table of
known architectures below, each with its source; `--params N` overrides the total.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from memexrl.config import Config, TrainSection
from memexrl.errors import MemexError
from memexrl.lora import count_lora_parameters, resolve_targets

GIB = 1024**3

# Architectures whose config.json may not be on this machine: the values that fix the parameter
# count, copied from the config.json the source names. Only used when the real config is not found.
_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}
KNOWN_ARCHITECTURES: dict[str, tuple[dict, str]] = {
    "Qwen/Qwen3-30B-A3B-Thinking-2507": (
        _QWEN3_30B_A3B,
        "config.json of huggingface.co/Qwen/Qwen3-30B-A3B-Thinking-2507 (model card: 30.5B total, 3.3B active)"),
    "Qwen/Qwen3-30B-A3B": (_QWEN3_30B_A3B, "config.json of huggingface.co/Qwen/Qwen3-30B-A3B"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (
        {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
         "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
        "config.json of huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"),
}
_ALIASES = {"smollm2-135m": ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
            "tiny-qwen3-moe": ("tiny-qwen3-moe", None)}  # name -> (memexrl cache subdir, Hub id)


# ---------------------------------------------------------------------------------- processes
def load_accelerate_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise MemexError(f"--accelerate-config {path}: cannot read it ({exc})") from exc
    if not isinstance(data, dict):
        raise MemexError(f"--accelerate-config {path}: not an accelerate YAML config")
    return data


def resolve_processes(num_processes: int | None, accelerate_cfg: Mapping, env: Mapping[str, str]) -> tuple[int, str]:
    """(number of training processes, where it comes from): argument, launcher env, accelerate config, else 1."""
    if num_processes:
        return num_processes, "--num-processes"
    for var in ("WORLD_SIZE", "ACCELERATE_NUM_PROCESSES"):  # set by accelerate launch / torchrun, or by you
        if env.get(var, "").isdigit() and int(env[var]) > 0:
            return int(env[var]), f"${var}"
    if accelerate_cfg.get("num_processes"):
        return int(accelerate_cfg["num_processes"]), "accelerate config num_processes"
    return 1, "default (no --num-processes, launcher environment or --accelerate-config)"


def resolve_zero_stage(accelerate_cfg: Mapping, env: Mapping[str, str]) -> tuple[int, str | None]:
    """(ZeRO stage, DeepSpeed config file) of the launch; stage -1 without DeepSpeed."""
    if accelerate_cfg:
        if str(accelerate_cfg.get("distributed_type", "")).upper() != "DEEPSPEED":
            return -1, None
        ds = accelerate_cfg.get("deepspeed_config") or {}
        file, stage = ds.get("deepspeed_config_file"), ds.get("zero_stage")
    elif env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        file, stage = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"), env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    else:
        return -1, None
    if file:
        try:
            stage = json.loads(Path(file).read_text()).get("zero_optimization", {}).get("stage", 0)
        except (OSError, ValueError) as exc:
            raise MemexError(f"DeepSpeed config {file}: cannot read it ({exc}); run from the repo root") from exc
    return int(stage if stage is not None else 2), file  # accelerate's default stage is 2


# ---------------------------------------------------------------------------------- parameters
@dataclass
class ModelNumbers:
    total: int  # all parameters
    linear: int | None  # weights of nn.Linear layers (what QLoRA stores in 4 bits); None: unknown
    lora: int | None  # LoRA adapter parameters for train.lora_r / lora_target_modules; None: unknown
    source: str
    lora_targets: str = ""  # the modules train.lora_target_modules resolves to on this architecture


def _find_config(name: str, cache: str):
    """(transformers config, source) for a model name, offline; (None, '') when not found."""
    from transformers import AutoConfig

    from memexrl.model_zoo import cache_dir
    from memexrl.models import adapter_base

    if name in _ALIASES:
        subdir, hub_id = _ALIASES[name]
        local = cache_dir(cache) / subdir
        if (local / "config.json").is_file():
            return AutoConfig.from_pretrained(local), f"{local / 'config.json'}"
        if hub_id is None:
            return None, ""
        name = hub_id
    path = Path(name).expanduser()
    base = adapter_base(path) if path.is_dir() else None
    if base:
        return _find_config(base, cache)
    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path), str(path / "config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True), f"{name} config.json (HF cache)"
    except (OSError, ValueError):
        pass
    if name in KNOWN_ARCHITECTURES:
        values, source = KNOWN_ARCHITECTURES[name]
        values = dict(values)
        return AutoConfig.for_model(values.pop("model_type"), **values), f"built-in table: {source}"
    return None, ""


def model_numbers(cfg: Config, params: int | None = None) -> ModelNumbers:
    """Count parameters from the config on the meta device (no weights are read)."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source = _find_config(cfg.model.name, cfg.model.cache_dir)
    if config is None:
        if params:
            return ModelNumbers(params, None, None, "--params")
        raise MemexError(f"cannot find the config.json of {cfg.model.name!r} offline (local dir, HF cache or "
                         f"memexrl.plan.KNOWN_ARCHITECTURES): pass --params N (the parameter count)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    t = cfg.train
    targets = resolve_targets(model, t.lora_target_modules)
    lora = count_lora_parameters(model, t.lora_r, t.lora_alpha, t.lora_target_modules)  # PEFT on the meta model
    shown = targets if isinstance(targets, str) else ",".join(targets)
    if params:
        return ModelNumbers(params, linear, lora, f"--params (architecture from {source})", shown)
    return ModelNumbers(total, linear, lora, source, shown)


# ---------------------------------------------------------------------------------- memory
_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def memory_per_process(numbers: ModelNumbers, finetune: str, weight_bytes: int, zero_stage: int,
                       processes: int) -> dict[str, float]:
    """Bytes per process: weights (+ frozen reference), gradients, Adam states; ZeRO shards by stage.

    ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also weights (and the reference,
    sharded like the policy). DeepSpeed keeps Adam's two moments in fp32 plus an fp32 master copy
    of 16-bit weights; torch's AdamW (no DeepSpeed) keeps the moments in the weights' dtype. LoRA
    adapters are fp32 (PEFT's default): only they have gradients and Adam states.
    """
    n = max(processes, 1)
    shard_w = n if zero_stage >= 3 else 1
    shard_g = n if zero_stage >= 2 else 1
    shard_o = n if zero_stage >= 1 else 1
    total = numbers.total
    if finetune == "qlora" and numbers.linear is not None:
        weights = 0.5 * numbers.linear + weight_bytes * (total - numbers.linear)
    else:
        weights = float(weight_bytes * total)
    out = {"weights": weights / shard_w, "reference": weights / shard_w if finetune == "full" else 0.0}
    if finetune == "full":
        adam = (8 + (4 if weight_bytes < 4 else 0)) if zero_stage >= 0 else 2 * weight_bytes
        out["gradients"] = weight_bytes * total / shard_g
        out["optimizer"] = adam * total / shard_o
    else:
        lora = numbers.lora or 0
        out["weights"] += 4 * lora  # adapters are small: counted whole on every process
        out["gradients"] = 4 * lora / shard_g
        out["optimizer"] = 8 * lora / shard_o
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------------------- the plan
def optimizer_steps_per_rollout_step(t: TrainSection) -> int:
    return t.tasks_per_step * t.group_size // t.global_batch_size


@dataclass
class Plan:
    processes: int
    processes_source: str
    zero_stage: int
    deepspeed_file: str | None
    rollouts_per_step: int
    tasks_per_process: int
    rollouts_per_process: int
    optimizer_steps_per_rollout_step: int
    trajectories_per_optimizer_step: int
    trajectories_per_optimizer_step_per_process: int
    total_optimizer_steps: int
    numbers: ModelNumbers | None
    weight_bytes: int
    memory: dict[str, float] = field(default_factory=dict)


def make_plan(cfg: Config, processes: int, processes_source: str, zero_stage: int = -1,
              deepspeed_file: str | None = None, numbers: ModelNumbers | None = None) -> Plan:
    """The batch arithmetic and memory estimate; the same divisibility checks as the trainer."""
    t = cfg.train
    if t.tasks_per_step % processes or t.global_batch_size % processes:
        raise MemexError(f"train.tasks_per_step ({t.tasks_per_step}) and train.global_batch_size "
                         f"({t.global_batch_size}) must be multiples of the {processes} processes")
    rollouts = t.tasks_per_step * t.group_size
    updates = optimizer_steps_per_rollout_step(t)
    weight_bytes = _BYTES.get(cfg.model.dtype.lower().removeprefix("torch."), 4)
    if zero_stage >= 0 and t.mixed_precision in ("bf16", "fp16"):
        weight_bytes = 2  # DeepSpeed casts the module to 16 bits and keeps an fp32 master copy
    plan = Plan(processes, processes_source, zero_stage, deepspeed_file, rollouts, t.tasks_per_step // processes,
                rollouts // processes, updates, t.global_batch_size, t.global_batch_size // processes,
                t.steps * updates, numbers, weight_bytes)
    if numbers is not None:
        plan.memory = memory_per_process(numbers, t.finetune, weight_bytes, zero_stage, processes)
    return plan


def _count(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def format_plan(plan: Plan, cfg: Config) -> str:
    t = cfg.train
    stage = f"DeepSpeed ZeRO-{plan.zero_stage} ({plan.deepspeed_file or 'accelerate config'})" \
        if plan.zero_stage >= 0 else "no DeepSpeed (plain accelerate)"
    lines = [
        f"model               {cfg.model.name} ({cfg.model.dtype}), finetune {t.finetune}"
        + (f" (LoRA r={t.lora_r}, {t.lora_target_modules}"
           + (f": {plan.numbers.lora_targets}" if plan.numbers and plan.numbers.lora_targets != t.lora_target_modules
              else "") + ")" if t.finetune != "full" else ""),
        f"processes           {plan.processes} [{plan.processes_source}], {stage}",
        f"rollouts per step   {plan.rollouts_per_step} = {t.tasks_per_step} tasks x G {t.group_size}; "
        f"per process {plan.tasks_per_process} tasks = {plan.rollouts_per_process} rollouts",
        f"optimizer steps     {plan.optimizer_steps_per_rollout_step} per rollout step "
        f"({plan.rollouts_per_step} / global batch {plan.trajectories_per_optimizer_step}), "
        f"{plan.total_optimizer_steps} over {t.steps} steps",
        f"per optimizer step  {plan.trajectories_per_optimizer_step} trajectories, "
        f"{plan.trajectories_per_optimizer_step_per_process} per process; micro-batches of {t.micro_batch_size} segment(s) "
        f"(>= {math.ceil(plan.trajectories_per_optimizer_step_per_process / t.micro_batch_size)} "
        f"micro-batches per process, more when trajectories compress)",
        f"context threshold   T = {cfg.memory.threshold} tokens, rollout window {cfg.rollout.max_context_tokens}",
        f"optimizer           Adam lr {t.learning_rate:g}, wd {t.weight_decay:g}, betas ({t.adam_beta1:g}, "
        f"{t.adam_beta2:g}), clip {t.max_grad_norm:g}, {t.lr_scheduler} schedule, mixed precision {t.mixed_precision}",
    ]
    n = plan.numbers
    if n is None:
        lines.append("parameters          unknown: pass --params N for a memory estimate")
        return "\n".join(lines)
    trained = n.total if t.finetune == "full" else n.lora
    lines.append(f"parameters          {_count(n.total)} total, {_count(trained)} trained [{n.source}]")
    m = plan.memory
    parts = ", ".join(f"{k} {m[k] / GIB:.{1 if m[k] >= GIB else 3}f}"
                      for k in ("weights", "reference", "gradients", "optimizer") if m[k])
    lines.append(f"memory per process  ~{m['total'] / GIB:.1f} GiB ({parts} GiB; {plan.weight_bytes}-byte weights); "
                 f"activations and KV cache not included")
    if plan.zero_stage >= 3 and cfg.rollout.engine == "transformers":
        lines.append(f"note                ZeRO-3 + transformers engine: generation gathers the whole model, "
                     f"+{plan.weight_bytes * n.total / GIB:.1f} GiB per process; use rollout.engine=vllm for large models")
    return "\n".join(lines)


def dry_run(cfg: Config, num_processes: int | None = None, accelerate_config: str | None = None,
            params: int | None = None, env: Mapping[str, str] | None = None) -> str:
    """The plan as printed by `memexrl train --dry-run`."""
    env = os.environ if env is None else env
    acc_cfg = load_accelerate_config(accelerate_config)
    processes, source = resolve_processes(num_processes, acc_cfg, env)
    stage, ds_file = resolve_zero_stage(acc_cfg, env)
    plan = make_plan(cfg, processes, source, stage, ds_file, model_numbers(cfg, params))
    return format_plan(plan, cfg)
