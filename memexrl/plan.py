"""`memexrl train --dry-run`: the resolved plan of a GRPO run, without loading the model or a GPU.

Pure functions over the config: how many processes and where that number comes from, the
batch arithmetic of training/trainer.py (rollouts per step, each process's share, optimizer
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
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from common.config import Config
from common.errors import MemexError
from memexrl.gpu_budget import GIB, Architecture, Budget, Offload, budget, format_budget, minimum_share
from modeling.lora import count_lora_parameters, resolve_targets
from modeling.quantize import is_quant_target

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
    arch: Architecture | None = None  # what activations and vLLM's memory depend on; None: unknown


def _find_config(name: str, cache: str):
    """(transformers config, source) for a model name, offline; (None, '') when not found."""
    from transformers import AutoConfig

    from modeling.load import adapter_base
    from modeling.zoo import cache_dir

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
    arch = architecture(config, model)
    if params:
        return ModelNumbers(params, linear, lora, f"--params (architecture from {source})", shown, arch)
    return ModelNumbers(total, linear, lora, source, shown, arch)


def architecture(config, model) -> Architecture:
    """Layers, widths and the sizes of the checkpoints vLLM would serve, from the config and the meta model."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    int4 = bf16 = 0
    for name, p in model.named_parameters():
        bf16 += 2 * p.numel()
        int4 += p.numel() * (0.5 + 2 / 128) if is_quant_target(name, p.shape, 128) else 2 * p.numel()
    return Architecture(layers=config.num_hidden_layers, hidden=config.hidden_size, vocab=config.vocab_size,
                        kv_bytes_per_token=2 * config.num_hidden_layers * kv_heads * head_dim * 2,
                        int4_bytes=int(int4), bf16_bytes=bf16)


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
    offload: Offload = field(default_factory=Offload)
    budget: Budget | None = None  # the GPU memory per process, phase by phase (None: a CPU run)


def make_plan(cfg: Config, processes: int, processes_source: str, zero_stage: int = -1,
              deepspeed_file: str | None = None, numbers: ModelNumbers | None = None,
              offload: Offload | None = None, gpu_gib: float | None = None) -> Plan:
    """The batch arithmetic and memory estimate; the same divisibility checks as the trainer.

    `offload`: the DeepSpeed config's offload switches (default: read from `deepspeed_file`); `gpu_gib`:
    the memory of one GPU, against which the budget is checked (None: not checked).
    """
    t = cfg.train
    if t.tasks_per_step % processes or t.global_batch_size % processes:
        raise MemexError(f"train.tasks_per_step ({t.tasks_per_step}) and train.global_batch_size "
                         f"({t.global_batch_size}) must be multiples of the {processes} processes")
    rollouts = t.tasks_per_step * t.group_size
    updates = t.updates_per_step
    weight_bytes = _BYTES.get(cfg.model.dtype.lower().removeprefix("torch."), 4)
    if zero_stage >= 0 and t.mixed_precision in ("bf16", "fp16"):
        weight_bytes = 2  # DeepSpeed casts the module to 16 bits and keeps an fp32 master copy
    plan = Plan(processes, processes_source, zero_stage, deepspeed_file, rollouts, t.tasks_per_step // processes,
                rollouts // processes, updates, t.global_batch_size, t.global_batch_size // processes,
                t.steps * updates, numbers, weight_bytes)
    if zero_stage >= 0:
        plan.offload = offload if offload is not None else Offload.of_deepspeed_file(deepspeed_file)
    if numbers is not None:
        plan.memory = memory_per_process(numbers, t.finetune, weight_bytes, zero_stage, processes)
        if cfg.model.device != "cpu":
            plan.budget = budget(cfg, plan.memory, numbers.arch, zero_stage, weight_bytes, plan.offload, gpu_gib)
    return plan


def what_would_fit(plan: Plan, cfg: Config) -> list[str]:
    """Changes that make a plan that does not fit fit, each checked with the same budget."""
    gpu, n = plan.budget.gpu_gib, plan.numbers
    t, r = cfg.train, cfg.rollout
    zero3 = max(plan.zero_stage, 3)

    def variant(config=cfg, processes=plan.processes, stage=zero3, offload=plan.offload):
        if config.train.tasks_per_step % processes or config.train.global_batch_size % processes:
            return None
        alt = make_plan(config, processes, "", stage, plan.deepspeed_file, n, offload, gpu)
        return alt.budget if alt.budget.fits else None

    found = []
    stage3 = "" if plan.zero_stage >= 3 else " under ZeRO-3"
    if r.engine == "vllm" and not r.vllm_server_url and plan.budget.vllm_share > plan.budget.vllm_needs:
        share = minimum_share(plan.budget, gpu)
        b = variant(replace(cfg, rollout=replace(r, vllm_gpu_memory_utilization=share)), stage=plan.zero_stage)
        if b:
            found.append(f"rollout.vllm_gpu_memory_utilization={share} (vLLM's weights + one window of KV): "
                         f"~{b.peak / GIB:.0f} GiB per GPU, fewer episodes in flight")
    if r.engine == "transformers":
        for size in (64, 32, 16, 8, 4, 2, 1):
            if size < r.batch_size and (b := variant(replace(cfg, rollout=replace(r, batch_size=size)),
                                                     stage=plan.zero_stage)):
                found.append(f"rollout.batch_size={size}: ~{b.peak / GIB:.0f} GiB per GPU")
                break
        vllm = replace(r, engine="vllm", vllm_model=r.vllm_model or "INT4", vllm_gpu_memory_utilization=0.35)
        if b := variant(replace(cfg, rollout=vllm, train=replace(t, fake_quant_group_size=128))):
            found.append(f"INT4 rollouts in a colocated vLLM{stage3} (rollout.engine=vllm, rollout.vllm_model=<memexrl "
                         f"quantize output>, train.fake_quant_group_size=128, 0.35 of the GPU: launch/paper-8gpu.sh "
                         f"MODE=full-int4): ~{b.peak / GIB:.0f} GiB per GPU")
    if t.finetune == "full" and not plan.offload.optimizer and (b := variant(offload=Offload(optimizer=True))):
        found.append(f"offload the optimizer states to host memory{stage3} (configs/accelerate/zero3-offload-8gpu.yaml): "
                     f"~{b.peak / GIB:.0f} GiB per GPU + {b.host / GIB:.0f} GiB of host memory per process")
    if t.finetune == "full" and (b := variant(replace(cfg, train=replace(t, finetune="lora")))):
        found.append(f"LoRA on the frozen base (train.finetune=lora){stage3}: ~{b.peak / GIB:.0f} GiB per GPU")
    for more in (2, 4, 8):
        if b := variant(processes=plan.processes * more):
            found.append(f"{plan.processes * more} GPUs{stage3}: ~{b.peak / GIB:.0f} GiB per GPU")
            break
    return found or ["nothing tried here fits (offload, LoRA, up to 8x the GPUs): lower the memory the config asks for"]


def gpu_memory_gib(cfg: Config, given: float | None) -> float | None:
    """--gpu-memory-gib, else the first visible GPU's memory when the run goes on a GPU (None: unknown)."""
    if given:
        return given
    if cfg.model.device == "cpu":
        return None
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return None


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
        f"{plan.total_optimizer_steps} over {t.steps} steps"
        + (f"; the batch counts segments (train.batch_unit): at least this many, one more per "
           f"{t.global_batch_size} extra segments" if t.batch_unit == "segments" else ""),
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
    offloaded = [k for k, on in (("optimizer", plan.offload.optimizer), ("weights", plan.offload.params)) if on]
    lines.append(f"trainer state       ~{m['total'] / GIB:.1f} GiB per process ({parts} GiB; {plan.weight_bytes}-byte "
                 f"weights)" + (f"; offloaded to host memory: {', '.join(offloaded)}" if offloaded else ""))
    b = plan.budget
    if b is None:
        return "\n".join(lines)
    lines.extend(format_budget(b, cfg))
    if b.fits is None:
        lines.append("fit                 not checked: no GPU visible; pass --gpu-memory-gib (80 for A100/H100 80GB, 141 "
                     "for H200)")
    elif b.fits:
        lines.append(f"fit                 fits: peak ~{b.peak / GIB:.1f} of {b.gpu_gib:.0f} GiB per GPU")
    else:
        why = (f"vLLM's share ({b.vllm_share / GIB:.1f} GiB) cannot hold its weights and one window of KV "
               f"({b.vllm_needs / GIB:.1f} GiB)" if b.vllm_share < b.vllm_needs else
               f"peak ~{b.peak / GIB:.1f} GiB > {b.gpu_gib:.0f} GiB per GPU")
        lines.append(f"fit                 DOES NOT FIT: {why}. What would fit:")
        lines.extend(f"                      - {fix}" for fix in what_would_fit(plan, cfg))
    return "\n".join(lines)


def dry_run(cfg: Config, num_processes: int | None = None, accelerate_config: str | None = None,
            params: int | None = None, env: Mapping[str, str] | None = None,
            gpu_gib: float | None = None) -> tuple[str, bool | None]:
    """(the plan as printed by `memexrl train --dry-run`, whether it fits the GPU: None when not checked)."""
    env = os.environ if env is None else env
    acc_cfg = load_accelerate_config(accelerate_config)
    processes, source = resolve_processes(num_processes, acc_cfg, env)
    stage, ds_file = resolve_zero_stage(acc_cfg, env)
    plan = make_plan(cfg, processes, source, stage, ds_file, model_numbers(cfg, params),
                     gpu_gib=gpu_memory_gib(cfg, gpu_gib))
    return format_plan(plan, cfg), plan.budget.fits if plan.budget else None
