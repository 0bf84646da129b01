#!/usr/bin/env bash
# 8 GPUs on one machine, the paper's numbers: Qwen3-30B-A3B-Thinking-2507, T 8000, 32 tasks x G 8 per step,
# global batch 128 (2 optimizer steps per rollout step), 50 steps, Adam lr 5e-6. Config: configs/paper-8gpu.yaml.
#
#   bash launch/paper-8gpu.sh                # MODE=full: the release's full fine-tuning, DeepSpeed ZeRO-3
#   MODE=full-int4 bash launch/paper-8gpu.sh # the paper's path B: full fine-tuning with INT4 fake-quant, ZeRO-3,
#                                            # colocated INT4 vLLM rollouts, re-quantised weights synced each step
#   MODE=lora bash launch/paper-8gpu.sh      # LoRA + INT4 fake-quant, INT4 vLLM rollouts, DeepSpeed ZeRO-2 (-3 on 80 GB)
#   GPU_GIB=80 MODE=full-int4 bash launch/paper-8gpu.sh   # pick the 80 GB configs (default: nvidia-smi's memory)
#   DRY_RUN=1 GPU_GIB=80 MODE=lora bash launch/paper-8gpu.sh  # only the plan, and whether it fits
#   bash launch/paper-8gpu.sh --resume train.save_steps=5   # extra arguments: `memexrl train` options, overrides
# Prerequisites (once, as in launch/h200-lora.sh: data, download, expert, sft, merge, quantize):
#   ALFWORLD_DATA (memexrl data alfworld), the SFT run in train.init_checkpoint (runs/sft-paper: e.g.
#   `accelerate launch --config_file configs/accelerate/zero2-8gpu.yaml -m memexrl.cli sft --config
#   configs/paper-8gpu.yaml sft.output_dir=runs/sft-paper sft.bf16=true sft.gradient_checkpointing=true
#   sft.deepspeed=configs/deepspeed/zero2.json sft.demos=runs/expert-qwen3/demos.jsonl`), and for MODE=lora
#   and MODE=full-int4 the INT4 start in $INT4_DIR (`memexrl quantize --model <merged SFT start> --out $INT4_DIR`).
#
# Which accelerate config, by MODE and by the GPUs' memory (GPU_GIB: detected with nvidia-smi, or set it), and
# the peak per GPU that `memexrl train --dry-run --gpu-memory-gib G` prints for it (memexrl/gpu_budget.py: trainer
# state, vLLM's share, activations of one 12K-token segment, 2 GiB CUDA overhead). The dry-run runs first and
# stops the recipe when the plan does not fit, with what would:
#   MODE=full       141 GB: zero3-8gpu.yaml, rollout.batch_size=8 (the in-process transformers engine gathers the
#                   whole model, 56.9 GiB, + the KV of 8 contexts): ~132 GiB. 80 GB: does not fit (use full-int4).
#                   Slow: the release ran Megatron TP4/EP8 with SGLang INT4 rollouts; MODE=full-int4 is that here.
#   MODE=full-int4  141 GB: zero3-8gpu.yaml: state 64.0 GiB (bf16 weights, reference and grads + fp32 Adam, all
#                   sharded 8 ways) + vLLM 0.35 x 141 = 49.3 GiB (INT4 weights 15.5 + KV) = ~115 GiB.
#                   80 GB: zero3-offload-8gpu.yaml (Adam's states in host memory: 42.7 GiB per process, ~342 GiB
#                   per node): 21.3 + 28.0 = ~51 GiB. Each sync gathers the sharded weights one tensor at a time.
#   MODE=lora       141 GB: zero2-8gpu.yaml (bf16 base replicated, 56.9 GiB) + vLLM 0.45 x 141 = ~122 GiB.
#                   80 GB: zero3-8gpu.yaml (the base sharded: 7.2 GiB) + vLLM 0.45 x 80 = ~45 GiB.
# Not verified on GPUs here (written on a CPU machine): the numbers are computed, not measured; the 2-rank CPU
# tests (tests/test_distributed.py) run every accelerate config named here.
trap '' USR1   # a preemption notice for the ranks alone (launch/README.md): the launcher inherits the ignore
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/paper-8gpu.yaml}   # configs/release.yaml: the release exactly (docs/fidelity.md)
MODE=${MODE:-full}
INT4_DIR=${INT4_DIR:-runs/qwen3-30b-a3b-int4}
PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=${WANDB_MODE:-offline}

if [[ -z "${GPU_GIB:-}" ]] && command -v nvidia-smi >/dev/null; then
  GPU_GIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 | awk '{print int($1 / 1024)}')
fi
GPU_GIB=${GPU_GIB:-141}
big=$(( GPU_GIB >= 120 ))   # 141 GB (H200) or 80 GB class

case $MODE in
  full)
    ACCEL=configs/accelerate/zero3-8gpu.yaml
    overrides=(rollout.batch_size=8) ;;
  full-int4)
    if ((big)); then ACCEL=configs/accelerate/zero3-8gpu.yaml; else ACCEL=configs/accelerate/zero3-offload-8gpu.yaml; fi
    overrides=(train.fake_quant_group_size=128 rollout.engine=vllm "rollout.vllm_model=$INT4_DIR"
               rollout.vllm_gpu_memory_utilization=0.35 train.output_dir=runs/paper-8gpu-int4) ;;
  lora)
    if ((big)); then ACCEL=configs/accelerate/zero2-8gpu.yaml; else ACCEL=configs/accelerate/zero3-8gpu.yaml; fi
    # 4 tasks x G 8 = 32 rollouts per GPU, each GPU's own colocated vLLM; the adapter is synced in-process.
    overrides=(train.finetune=lora train.fake_quant_group_size=128 train.learning_rate=2e-5
               train.lora_target_modules=q_proj,k_proj,v_proj,o_proj rollout.engine=vllm
               "rollout.vllm_model=$INT4_DIR" rollout.vllm_gpu_memory_utilization=0.45
               train.output_dir=runs/paper-8gpu-lora) ;;
  *) echo "MODE must be full, full-int4 or lora, not '$MODE'" >&2; exit 2 ;;
esac

source "$(dirname "${BASH_SOURCE[0]}")/_args.sh"  # -> opts=(...), overrides+=(...)

if [[ -z "${ALFWORLD_DATA:-}" ]]; then
  $PY -m memexrl data alfworld          # unpacks $ALFWORLD_ARCHIVE (or downloads) into data/alfworld
  export ALFWORLD_DATA=$PWD/data/alfworld
fi

# The plan first (processes, batches, memory per process), then the run.
$PY -m memexrl train --config "$CONFIG" --dry-run --accelerate-config "$ACCEL" --gpu-memory-gib "$GPU_GIB" \
  ${overrides[@]+"${overrides[@]}"}
[[ -n "${DRY_RUN:-}" ]] && exit 0   # DRY_RUN=1: the plan only
accelerate launch --config_file "$ACCEL" -m memexrl.cli train --config "$CONFIG" ${opts[@]+"${opts[@]}"} \
  ${overrides[@]+"${overrides[@]}"}

# the config's train.output_dir, unless MODE's or yours (the last one wins) says otherwise
run_dir=$($PY -c "from common.config import load_config; print(load_config('$CONFIG').train.output_dir)")
for o in ${overrides[@]+"${overrides[@]}"}; do [[ $o == train.output_dir=* ]] && run_dir=${o#train.output_dir=}; done
$PY -m memexrl plot "$run_dir"
# Resume: `MODE=... bash launch/paper-8gpu.sh --resume` (same MODE: a ZeRO checkpoint resumes under the same
# kind of launch). Curves: $run_dir/plots/*.png; wandb files in $run_dir/wandb/.
