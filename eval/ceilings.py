"""What this machine can do, and what a model's tokens cost: the ceilings the benchmarks measure phases against.

- `matmul_flops(dtype, threads)`: FLOP/s of square `F.linear` calls in `dtype` (the kernel the model's layers use;
  on an AVX2 CPU a bfloat16 `a @ b` takes a 10x slower path), on the CPU at a thread count or on the GPU;
- `memory_bandwidth(threads)`: bytes/s of a large copy (each byte read once and written once);
- `ModelCost.of(model)`: a forward's FLOPs per token (2 per matmul weight, MoE experts at their active share, the
  output layer included), attention's FLOPs per (query, key) pair, KV-cache and weight bytes per dtype.

A phase's ceiling is the roofline: its least possible time is max(FLOPs / matmul FLOP/s, bytes / bandwidth), and its
share of the ceiling is that time over the time it took; the larger term names the bound (compute or memory).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """torch computes on `n` threads inside the block (the CPU's ceilings at a phase's own thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _timed(fn, device: torch.device, seconds: float) -> tuple[int, float]:
    """Calls of `fn` in about `seconds` after a warm-up, and the seconds they took."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        count += 1
    sync()
    return count, time.perf_counter() - start


def matmul_flops(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0, threads: int = 0,
                 device: str | torch.device = "cpu") -> float:
    """FLOP/s of (n x n) linear layers in `dtype`, timed for about `seconds`, on `threads` CPU threads (0: torch's
    current number) or on the GPU `device` (n 4096 there, to fill it)."""
    device = torch.device(device)
    n = 4096 if device.type == "cuda" else n
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    with torch_threads(threads or torch.get_num_threads()):
        count, took = _timed(lambda: torch.nn.functional.linear(a, b), device, seconds)
    return 2 * n**3 * count / took


def memory_bandwidth(mib: int = 512, seconds: float = 1.0, threads: int = 0, device: str | torch.device = "cpu") -> float:
    """Bytes/s of copying a `mib` MiB buffer into another (read + write), on `threads` CPU threads or the GPU: well
    past the last-level cache, what streaming weights or a KV cache can reach."""
    device = torch.device(device)
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    with torch_threads(threads or torch.get_num_threads()):
        count, took = _timed(lambda: dst.copy_(src), device, seconds)
    return 2 * src.numel() * count / took


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _base(model):
    """The transformers model under PEFT / DDP / DeepSpeed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass(frozen=True)
class ModelCost:
    """What a token costs a model: matmul weights it goes through, and the attention's shape."""

    matmul_params: int  # weights a token multiplies by (output layer included; MoE experts at top_k / num_experts)
    trained_params: int  # parameters with requires_grad (LoRA: the adapters)
    total_params: int  # every weight of the model in memory once (tied weights once)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    hidden: int

    @classmethod
    def of(cls, model) -> ModelCost:
        base = _base(model)
        c = base.config
        c = getattr(c, "text_config", None) or c
        experts, active = getattr(c, "num_experts", 0) or 0, getattr(c, "num_experts_per_tok", 0) or 0
        share = active / experts if experts and active else 1.0
        matmul = 0.0
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear):
                matmul += module.weight.numel() * (share if ".experts." in f".{name}." else 1.0)
        fused_experts = sum(p.numel() for n, p in base.named_parameters()
                            if ".experts." in n and p.dim() == 3)  # transformers 5 fuses the experts: (E, out, in)
        matmul += fused_experts * share
        heads = c.num_attention_heads
        return cls(
            matmul_params=int(matmul),
            trained_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
            total_params=sum(p.numel() for p in base.parameters()),
            layers=c.num_hidden_layers, heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab=c.vocab_size, hidden=c.hidden_size,
        )

    @property
    def flops_per_token(self) -> float:
        """A forward's matmul FLOPs for one token (2 per weight: a multiply and an add)."""
        return 2.0 * self.matmul_params

    @property
    def head_flops_per_token(self) -> float:
        """The output layer's share of `flops_per_token` (hidden x vocabulary)."""
        return 2.0 * self.hidden * self.vocab

    @property
    def flops_per_attended_pair(self) -> float:
        """Attention's FLOPs for one (query, key) pair in a forward: QK^T and the weighted sum of V, every layer."""
        return 4.0 * self.layers * self.heads * self.head_dim

    def kv_bytes_per_token(self, dtype: str) -> int:
        """A token's keys and values in the KV cache, every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(dtype)

    def weight_bytes(self, dtype: str) -> int:
        """The weights a forward streams once (embeddings are looked up, not streamed: counted as matmul weights)."""
        return self.matmul_params * dtype_bytes(dtype)
