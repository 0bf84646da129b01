#!/usr/bin/env bash
# 8 GPUs on one machine, the paper's numbers: Qwen3-30B-A3B-Thinking-2507, T 8000, 32 tasks x G 8 per step,
# global batch 128 (2 optimizer steps per rollout step), 50 steps, Adam lr 5e-6. Config: configs/paper-8gpu.yaml.
#
#   bash launch/paper-8gpu.sh                # MODE=full: the release's full fine-tuning, DeepSpeed ZeRO-3
#   MODE=full-int4 bash launch/paper-8gpu.sh # the paper's path B: full fine-tuning with INT4 fake-quant, ZeRO-3,
#                                            # colocated INT4 vLLM rollouts, re-quantised weights synced each step
#   MODE=lora bash launch/paper-8gpu.sh      # LoRA + INT4 fake-quant, INT4 vLLM rollouts, DeepSpeed ZeRO-2
#   bash launch/paper-8gpu.sh --resume train.save_steps=5   # extra arguments: `memexrl train` options, overrides
# Prerequisites (once, as in launch/h200-lora.sh: data, download, expert, sft, merge, quantize):
#   ALFWORLD_DATA (memexrl data alfworld), the SFT run in train.init_checkpoint (runs/sft-paper: e.g.
#   `accelerate launch --config_file configs/accelerate/zero2-8gpu.yaml -m memexrl.cli sft --config
#   configs/paper-8gpu.yaml sft.output_dir=runs/sft-paper sft.bf16=true sft.gradient_checkpointing=true
#   sft.deepspeed=configs/deepspeed/zero2.json sft.demos=runs/expert-qwen3/demos.jsonl`), and for MODE=lora
#   and MODE=full-int4 the INT4 start in $INT4_DIR (`memexrl quantize --model <merged SFT start> --out $INT4_DIR`).
#
# GPU memory per GPU (30.53B params; `memexrl train --config configs/paper-8gpu.yaml --dry-run
# --accelerate-config <the accelerate config>` prints the first numbers):
#   MODE=full, ZeRO-3   ~64 GiB: bf16 weights 7.1 + frozen reference 7.1 + bf16 grads 7.1 + Adam (fp32 m, v
#                       and master weights, 12 bytes/param) 42.7, all sharded 8 ways. Rollouts use the
#                       in-process transformers engine (paper-8gpu.yaml: rollout.engine transformers), which
#                       gathers the whole model on every GPU for generation: +56.9 GiB, plus its KV cache
#                       (96 KiB/token) and activations: > 121 GiB, so only 141 GB GPUs (H200), with
#                       rollout.batch_size lowered until it fits, and slow. The release ran Megatron TP4/EP8 on
#                       8 H100 with SGLang INT4 rollouts: MODE=full-int4 is that setting here.
#   MODE=full-int4, ZeRO-3  ~64 GiB as MODE=full (the fake-quant adds one layer's INT4 copy at a time) +
#                       the colocated vLLM at vllm_gpu_memory_utilization 0.35 (~49 GiB: INT4 weights 15.5 GiB
#                       + KV cache; asleep during the update) = ~113 GiB: 141 GB GPUs (H200). Each sync gathers
#                       the sharded weights one tensor at a time into host memory (a bf16 copy, 61 GB per
#                       process: ~490 GB host RAM on the node) and re-quantises them into the INT4 format.
#   MODE=lora, ZeRO-2   ~57 GiB trainer (bf16 base replicated on each GPU, adapter 13.4M params, its grads and
#                       Adam sharded: < 0.1 GiB) + the colocated vLLM of each process at
#                       vllm_gpu_memory_utilization 0.45 (~62 GiB: INT4 weights 15.5 GiB + KV cache; it sleeps
#                       during the update) = ~121 GiB: 141 GB GPUs (H200). Does not fit 80 GB GPUs.
#   Both: activations of the update with gradient checkpointing are ~3 GiB of layer inputs per 16K tokens plus
#   the fp32 logits of the trained span (~14 GiB for 8K tokens); micro batch 1 segment.
#
# Not verified on GPUs here (written on a CPU machine): the numbers are computed, not measured.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=configs/paper-8gpu.yaml
MODE=${MODE:-full}
INT4_DIR=${INT4_DIR:-runs/qwen3-30b-a3b-int4}
PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=${WANDB_MODE:-offline}

case $MODE in
  full)
    ACCEL=configs/accelerate/zero3-8gpu.yaml
    overrides=() ;;
  full-int4)
    ACCEL=configs/accelerate/zero3-8gpu.yaml
    overrides=(train.fake_quant_group_size=128 rollout.engine=vllm "rollout.vllm_model=$INT4_DIR"
               rollout.vllm_gpu_memory_utilization=0.35 train.output_dir=runs/paper-8gpu-int4) ;;
  lora)
    ACCEL=configs/accelerate/zero2-8gpu.yaml
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
$PY -m memexrl train --config "$CONFIG" --dry-run --accelerate-config "$ACCEL" ${overrides[@]+"${overrides[@]}"}
accelerate launch --config_file "$ACCEL" -m memexrl.cli train --config "$CONFIG" ${opts[@]+"${opts[@]}"} \
  ${overrides[@]+"${overrides[@]}"}

case $MODE in  # the train.output_dir each MODE sets above
  full) run_dir=runs/paper-8gpu ;;
  full-int4) run_dir=runs/paper-8gpu-int4 ;;
  lora) run_dir=runs/paper-8gpu-lora ;;
esac
$PY -m memexrl plot "$run_dir"
# Resume: `MODE=... bash launch/paper-8gpu.sh --resume` (same MODE: a ZeRO checkpoint resumes under the same
# kind of launch). Curves: $run_dir/plots/*.png; wandb files in $run_dir/wandb/.
