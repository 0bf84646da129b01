"""`memexrl bench sft`: one SFT training step in float32 vs bfloat16 autocast (`sft.bf16`), side by side.

What `memexrl sft` runs on the CPU, one step of it: the config's policy (model.name) with the config's LoRA
(`sft.lora`, `sft.lora_r`, ...; full fine-tuning when sft.lora is false), one sequence of `--segment-tokens`
tokens, a forward pass with the causal-LM loss, backward, an AdamW step. The bfloat16 side is what TRL's
`bf16=True` does on the CPU (accelerate: `torch.autocast("cpu", torch.bfloat16)` around the forward pass;
the weights and the optimizer stay float32). Runs alternate float32 / bfloat16, the order swapped every
round, so drift in the machine's load hits both sides alike; medians are compared. The token ids are random
(time depends on the shapes alone); the loss of both on the same weights, before any step, is reported: a
check that autocast computes the same loss. Whether the CPU has native bfloat16 (AVX-512 BF16 or AMX; modeling.load's
`cpu_has_native_bf16`) is printed: without it, bfloat16 is emulated and slower.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from common.config import load_config
from eval.bench_trainer import DEFAULT_CONFIG


@dataclass
class SftStepTimes:
    native_bf16: bool
    tokens: int
    float32_seconds: list[float]
    bf16_seconds: list[float]
    float32_loss: float
    bf16_loss: float


def _training_model(cfg):
    from modeling.load import load_policy
    from modeling.lora import lora_config

    model, _ = load_policy(cfg.model, for_training=True)
    s = cfg.sft
    if s.lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(model, s.lora_r, s.lora_alpha, s.lora_dropout, s.lora_target_modules))
    return model


def bench_sft(config: str | None, overrides: list[str] | None, tokens: int, runs: int) -> SftStepTimes:
    import torch

    from modeling.load import cpu_has_native_bf16

    cfg = load_config(config or DEFAULT_CONFIG, [*(overrides or []), "model.device=cpu", "model.dtype=float32"])
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model = _training_model(cfg)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.learning_rate)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))

    def loss_of(bf16: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(input_ids=ids, labels=ids).loss

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        loss_of(bf16).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    with torch.no_grad():  # the same weights for both losses, before any step
        losses = {bf16: loss_of(bf16).item() for bf16 in (False, True)}
    seconds: dict[bool, list[float]] = {False: [], True: []}
    step(False)  # warm-up (oneDNN primitives, allocator), not timed
    for i in range(runs):
        for bf16 in ((False, True) if i % 2 == 0 else (True, False)):
            seconds[bf16].append(step(bf16))
    return SftStepTimes(cpu_has_native_bf16(), tokens, seconds[False], seconds[True], losses[False], losses[True])


def format_bench_sft(r: SftStepTimes) -> str:
    f32, b16 = statistics.median(r.float32_seconds), statistics.median(r.bf16_seconds)
    return "\n".join([
        f"SFT step, one sequence of {r.tokens} tokens, forward + backward + AdamW, one thread "
        f"(native bfloat16 on this CPU: {'yes' if r.native_bf16 else 'no'}), medians of {len(r.float32_seconds)} runs:",
        f"  float32            {f32:7.2f} s  {r.tokens / f32:7.1f} tokens/s  loss {r.float32_loss:.4f}",
        f"  bfloat16 autocast  {b16:7.2f} s  {r.tokens / b16:7.1f} tokens/s  loss {r.bf16_loss:.4f}",
        f"  bfloat16 / float32 speed: {f32 / b16:.3g}x",
    ])
