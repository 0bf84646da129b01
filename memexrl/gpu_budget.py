"""Does a GRPO plan fit the GPU? Peak memory per GPU of `memexrl train`, phase by phase (`--dry-run`).

Each training process owns one GPU. What it holds, by phase of a step (training/trainer.py):
  rollout   the trainer's resident state (weights, frozen reference, gradient and optimizer partitions:
            memexrl/plan.py `memory_per_process`) + the colocated vLLM's share of the GPU
            (rollout.vllm_gpu_memory_utilization x GPU memory: its weights and KV cache), or, for the
            in-process transformers engine, the KV cache of rollout.batch_size working contexts of S
            tokens (+ the whole model, which ZeRO-3 gathers for generation)
  update    the resident state + the update's activations; the colocated vLLM sleeps (level 1: weights
            to host memory, KV cache freed), so it holds nothing
  both      + a fixed CUDA_OVERHEAD_GIB for the CUDA context, NCCL buffers and allocator fragmentation
vLLM also needs its share to hold its own weights plus the KV cache of one sequence of the rollout window.

Activations (one micro-batch of micro_batch_size segments of S tokens; a segment is about T + one turn,
memex.md "Training"): with gradient checkpointing, every layer's input (L x S x hidden x 2 bytes) plus one
layer's working set recomputed in the backward, ACTIVATION_BYTES_PER_TOKEN_HIDDEN x S x hidden bytes
(34: Korthikanti et al. 2022, "Reducing activation recomputation", eq. 1 without the attention-score
term that fused attention kernels never store); without it, that working set for every layer. The output
layer's fp32 logits, their log-softmax and its gradient over the positions it runs on (S, or
train.head_chunk_size at a time): 3 x 4 bytes x vocabulary per position.

Optimizer / parameter offload (`offload_optimizer` / `offload_param` in the DeepSpeed JSON) move those
states to host memory; the host memory they need is reported beside the GPU figure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3
CUDA_OVERHEAD_GIB = 2.0
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
LOGIT_COPIES = 3  # fp32 logits, log-softmax, its gradient


@dataclass(frozen=True)
class Offload:
    optimizer: bool = False
    params: bool = False

    @classmethod
    def of_deepspeed_file(cls, path: str | None) -> Offload:
        if not path:
            return cls()
        zero = json.loads(Path(path).read_text()).get("zero_optimization", {})

        def on(key: str) -> bool:
            return str((zero.get(key) or {}).get("device", "none")).lower() in ("cpu", "nvme")

        return cls(optimizer=on("offload_optimizer"), params=on("offload_param"))


@dataclass(frozen=True)
class Architecture:
    """What the memory of activations and of vLLM depends on (from the model's config, on the meta device)."""

    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token: int  # K and V of every layer, 2-byte cache
    int4_bytes: int  # the `memexrl quantize` checkpoint vLLM serves (INT4 group 128, the rest bf16)
    bf16_bytes: int


@dataclass
class Budget:
    gpu_gib: float | None
    resident: float  # the trainer's state, bytes
    vllm_share: float  # bytes the colocated vLLM takes while it is awake (0: no colocated vLLM)
    vllm_needs: float  # its weights + one window of KV cache
    generation: float  # the transformers engine's KV cache (+ `gathered`)
    activations: float
    host: float  # offloaded states, bytes of host memory per process
    segment_tokens: int
    notes: list[str] = field(default_factory=list)
    gathered: float = 0.0  # the whole model ZeRO-3 gathers for the transformers engine, part of `generation`

    @property
    def rollout_peak(self) -> float:
        return self.resident + self.vllm_share + self.generation + CUDA_OVERHEAD_GIB * GIB

    @property
    def update_peak(self) -> float:
        return self.resident + self.activations + CUDA_OVERHEAD_GIB * GIB

    @property
    def peak(self) -> float:
        return max(self.rollout_peak, self.update_peak)

    @property
    def fits(self) -> bool | None:
        if self.gpu_gib is None:
            return None
        return self.peak <= self.gpu_gib * GIB and self.vllm_share >= self.vllm_needs


def segment_tokens(cfg) -> int:
    """Tokens of one trained segment: about T plus one turn, never more than the rollout window."""
    return min(cfg.rollout.max_context_tokens, cfg.memory.threshold + cfg.rollout.max_new_tokens)


def activation_bytes(cfg, arch: Architecture, weight_bytes: int) -> float:
    t = cfg.train
    tokens = t.micro_batch_size * segment_tokens(cfg)
    act = 2 if weight_bytes <= 2 or t.mixed_precision != "no" else 4
    layer = ACTIVATION_BYTES_PER_TOKEN_HIDDEN / 2 * act * tokens * arch.hidden
    if t.gradient_checkpointing:
        layers = arch.layers * tokens * arch.hidden * act + layer
    else:
        layers = arch.layers * layer
    positions = min(tokens, t.head_chunk_size * t.micro_batch_size) if t.head_chunk_size > 0 else tokens
    return layers + LOGIT_COPIES * 4 * arch.vocab * positions


def budget(cfg, memory: dict, arch: Architecture | None, zero_stage: int, weight_bytes: int, offload: Offload,
           gpu_gib: float | None) -> Budget:
    """The peak GPU memory of one process of the plan (`memory`: plan.memory_per_process's split, bytes)."""
    moved = memory["optimizer"] if offload.optimizer else 0.0
    if offload.params and zero_stage >= 3:
        moved += memory["weights"] + memory["reference"]
    resident = memory["total"] - moved
    b = Budget(gpu_gib, resident, 0.0, 0.0, 0.0, 0.0, moved, segment_tokens(cfg))
    r = cfg.rollout
    if arch is None:
        b.notes.append("architecture unknown (--params): activations and vLLM's needs not counted")
        return b
    b.activations = activation_bytes(cfg, arch, weight_bytes)
    window = arch.kv_bytes_per_token * r.max_context_tokens
    colocated = r.engine == "vllm" and not r.vllm_server_url
    if colocated:
        served = arch.int4_bytes if (r.vllm_model or cfg.train.fake_quant_group_size) else arch.bf16_bytes
        b.vllm_needs = served + window
        b.vllm_share = r.vllm_gpu_memory_utilization * gpu_gib * GIB if gpu_gib else b.vllm_needs
        if gpu_gib is None:
            b.notes.append("GPU memory unknown: vLLM's share counted as its minimum (weights + one window of KV)")
    elif r.engine == "transformers":  # the KV cache of the batch's working contexts, + the whole model under ZeRO-3
        b.gathered = arch.bf16_bytes / 2 * weight_bytes if zero_stage >= 3 else 0.0  # in the trainer's dtype
        b.generation = arch.kv_bytes_per_token * b.segment_tokens * r.batch_size + b.gathered
    return b


def minimum_share(b: Budget, gpu_gib: float) -> float:
    """The smallest rollout.vllm_gpu_memory_utilization that holds vLLM's weights and one window of KV."""
    return math.ceil(100 * b.vllm_needs / (gpu_gib * GIB)) / 100


def format_budget(b: Budget, cfg) -> list[str]:
    lines = []
    parts = [f"trainer state {b.resident / GIB:.1f}"]
    if b.vllm_share:
        parts.append(f"vLLM {b.vllm_share / GIB:.1f} (needs >= {b.vllm_needs / GIB:.1f}: weights + one "
                     f"{cfg.rollout.max_context_tokens}-token window of KV)")
    if b.generation:
        parts.append(f"transformers engine {b.generation / GIB:.1f} (KV of {cfg.rollout.batch_size} contexts"
                     + (f", the whole model gathered by ZeRO-3 {b.gathered / GIB:.1f})" if b.gathered else ")"))
    lines.append(f"GPU at rollout      ~{b.rollout_peak / GIB:.1f} GiB ({', '.join(parts)}, "
                 f"CUDA {CUDA_OVERHEAD_GIB:.0f} GiB)")
    lines.append(f"GPU at update       ~{b.update_peak / GIB:.1f} GiB (trainer state {b.resident / GIB:.1f}, "
                 f"activations {b.activations / GIB:.1f} for {cfg.train.micro_batch_size} x {b.segment_tokens}-token "
                 f"segments, CUDA {CUDA_OVERHEAD_GIB:.0f} GiB" + ("; vLLM asleep)" if b.vllm_share else ")"))
    if b.host:
        lines.append(f"host memory         {b.host / GIB:.1f} GiB per process of offloaded states")
    lines.extend(f"note                {n}" for n in b.notes)
    return lines
