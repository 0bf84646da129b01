#!/usr/bin/env bash
# One H200: Qwen3-30B-A3B-Thinking-2507, INT4 W4A16 rollouts in a colocated vLLM, LoRA GRPO on the INT4
# fake-quantised bf16 base (path A). Config: configs/h200-lora.yaml. Accelerate: configs/accelerate/single.yaml.
#
#   bash launch/h200-lora.sh            # every step below in order; a step whose output exists is skipped
#   bash launch/h200-lora.sh STEP       # one step: data | download | expert | sft | merge | quantize | train | resume | plot
#   bash launch/h200-lora.sh dirs       # where each step reads and writes (from the config)
#   bash launch/h200-lora.sh train train.steps=20     # extra arguments: overrides (and options) for sft / train
# Run from anywhere (it cd's to the repo root), with the [gpu] extra installed: pip install -e ".[gpu]".
# Run launch/gpu-check.sh first on a new machine (random weights, no download, < 8 minutes).
#
# GPU memory (H200: 141 GB = ~139 GiB usable). From the architecture (memexrl/plan.py's table: 48 layers,
# hidden 2048, 32 q / 4 kv heads of 128, 128 experts of width 768, top-8, vocab 151936, untied head):
#   per layer 623.1M params = experts 604.0M + attention 18.9M + router 0.26M; embeddings + head 622.3M
#   trainer base, bf16      30.53B x 2 bytes = 61.1 GB = 56.9 GiB (`memexrl train --dry-run`: 57.1 GiB with
#                           LoRA). Fake-quant rewrites the frozen weights in place: still bf16, no extra copy.
#   LoRA r16 (q,k,v,o)      13.4M params: fp32 adapter 0.05 + grads 0.05 + Adam 0.10 GiB; no reference copy
#                           (the reference is the same model with the adapter disabled)
#   vLLM INT4 weights       every decoder linear (29.9B) at 4 bits + a bf16 scale per 128 = 0.516 bytes/param
#                           = 15.4 GB; router, norms, embeddings and lm_head stay bf16 (0.64B params = 1.3 GB):
#                           16.7 GB = 15.5 GiB. (`--experts-only`, slime's choice, keeps attention bf16 too:
#                           18.0 GB = 16.8 GiB, but then the trainer's fake-quant, which also covers attention,
#                           no longer matches the rollout weights: quantize without it, as below.)
#   vLLM KV cache           48 layers x 2 x 4 kv heads x 128 x 2 bytes = 96 KiB per token (3 GiB per 32K
#                           sequence); rollout.vllm_gpu_memory_utilization 0.45 = ~62 GiB for vLLM = 15.5 GiB
#                           weights + ~2 GiB activations/graphs + ~44 GiB KV (~470K tokens: 64 episodes of
#                           ~7K tokens; more preempt and wait)
#   rollout phase           57 (trainer) + 62 (vLLM) + ~2 (CUDA contexts) = ~121 GiB
#   update phase            vLLM sleeps (level 1: weights to host RAM, KV freed; ~1-2 GiB stay), the trainer
#                           has ~80 GiB for activations: with gradient checkpointing ~0.19 MiB per token per
#                           layer boundary (3 GiB for 16K tokens over 48 layers), one layer recomputed at a
#                           time, and the logits of the trained span in fp32 (151936 x 4 bytes = 0.6 MiB per
#                           token, x ~3 with log_softmax and its gradient: ~14 GiB for an 8K-token span)
#   host RAM                vLLM's sleeping weights (~16 GiB) + 16 ALFWorld workers (~0.5 GB each)
#   caveat                  vLLM's wake_up re-allocates its ~62 GiB after the update: the trainer's PyTorch
#                           cache must not still hold the update's activations then (torch.cuda.empty_cache()
#                           before wake_up; training/trainer.py does not call it today). If wake_up runs out of
#                           memory, lower rollout.vllm_gpu_memory_utilization (0.35 leaves ~14 GiB more).
#   disk                    HF cache 61 GB + merged SFT start 61 GB + INT4 17 GB + checkpoints (adapters, small)
#
# Not verified on a GPU here (written on a CPU machine without vLLM GPU support): the numbers above are
# computed, not measured; launch/gpu-check.sh measures them on a slice of the architecture.
trap '' USR1   # a preemption notice for the ranks alone (launch/README.md): the launcher inherits the ignore
set -euo pipefail
cd "$(dirname "$0")/.."

# The reading run of issue 27 (configs/h200-reading.yaml, its header) takes the same steps:
#   CONFIG=configs/h200-reading.yaml bash launch/h200-lora.sh [STEP]
CONFIG=${CONFIG:-configs/h200-lora.yaml}
ACCEL=configs/accelerate/single.yaml
BASE_HF=Qwen/Qwen3-30B-A3B-Thinking-2507
EXPERT_GAMES=${EXPERT_GAMES:-600}
PY=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}       # the env workers are processes; keep torch's CPU threads few
export WANDB_MODE=${WANDB_MODE:-offline}           # `wandb login` and WANDB_MODE=online for live curves

step=${1:-all}
shift || true
source "$(dirname "${BASH_SOURCE[0]}")/_args.sh"  # -> opts=(...) overrides=(...)

# The directories come from the config (with the overrides above), so a step never reads another run's files:
#   EXPERT_DIR = sft.demos's directory, SFT_DIR = sft.output_dir (= train.init_checkpoint), INT4_DIR =
#   rollout.vllm_model, RUN_DIR = train.output_dir, READING_TASKS = train.reading_tasks when train.env is
#   reading (the reader-expert instead of ALFWorld's); MERGED_DIR = SFT_DIR/merged-bf16 (the SFT start merged
#   into its base, what `quantize` reads). MERGED_DIR=... in the environment puts the merged model elsewhere.
dirs=$($PY - "$CONFIG" ${overrides[@]+"${overrides[@]}"} <<'EOF'
import shlex, sys
from pathlib import Path
from common.config import load_config
from common.errors import MemexError
try:
    cfg = load_config(sys.argv[1], sys.argv[2:])
except MemexError as exc:
    sys.exit(str(exc))
if cfg.train.init_checkpoint and Path(cfg.train.init_checkpoint) != Path(cfg.sft.output_dir):
    sys.exit(f"{sys.argv[1]}: train.init_checkpoint ({cfg.train.init_checkpoint}) is not sft.output_dir "
             f"({cfg.sft.output_dir}); the recipe starts GRPO from its own SFT run: make them the same")
dirs = {"EXPERT_DIR": str(Path(cfg.sft.demos).parent), "SFT_DIR": cfg.sft.output_dir,
        "INT4_DIR": cfg.rollout.vllm_model, "RUN_DIR": cfg.train.output_dir,
        "READING_TASKS": cfg.train.reading_tasks if cfg.train.env == "reading" else ""}
print("\n".join(f"{k}={shlex.quote(v)}" for k, v in dirs.items()))
EOF
)  # a failure stops here (set -e)
eval "$dirs"
MERGED_DIR=${MERGED_DIR:-$SFT_DIR/merged-bf16}

run_data() {  # ALFWorld games: $ALFWORLD_ARCHIVE (or --archive FILE) else ALFWorld's own download
  if [[ -n "${ALFWORLD_DATA:-}" ]]; then echo "ALFWORLD_DATA=$ALFWORLD_DATA"; return; fi
  $PY -m memexrl data alfworld
  export ALFWORLD_DATA=$PWD/data/alfworld
}

run_download() {  # the bf16 base into the HF cache once (61 GB; needs the Hub the first time); prints its path
  $PY -c 'import sys; from huggingface_hub import snapshot_download; print(snapshot_download(sys.argv[1]))' \
    "$BASE_HF" | tail -n 1
}

run_expert() {  # Memex expert demonstrations, tokenised with Qwen3's tokenizer (the config's model)
  [[ -f $EXPERT_DIR/demos.jsonl ]] && return
  if [[ -n $READING_TASKS ]]; then
    $PY -m memexrl expert --reading-tasks "$READING_TASKS" --out "$EXPERT_DIR" --config "$CONFIG"
  else
    $PY -m memexrl expert --split train --games "$EXPERT_GAMES" --out "$EXPERT_DIR" --config "$CONFIG"
  fi
}

run_sft() {  # LoRA SFT warm start (TRL, bf16, gradient checkpointing), then a post-SFT check on 4 games
  [[ -d $SFT_DIR/checkpoints ]] && return
  accelerate launch --config_file "$ACCEL" -m memexrl.cli sft --config "$CONFIG" ${overrides[@]+"${overrides[@]}"}
}

run_merge() {  # the starting policy as one bf16 checkpoint: base + SFT adapter, merged (what vLLM must serve)
  [[ -f $MERGED_DIR/config.json ]] && return
  $PY - "$CONFIG" "$MERGED_DIR" <<'EOF'
import sys
from dataclasses import replace
from common.config import load_config
from training.policy import init_source
from modeling.load import load_policy
cfg = load_config(sys.argv[1])
source = init_source(cfg)  # train.init_checkpoint: the SFT run's newest checkpoint
model, tokenizer = load_policy(replace(cfg.model, name=source))  # an adapter is merged into its base
model.save_pretrained(sys.argv[2])
tokenizer.save_pretrained(sys.argv[2])
print(f"merged {source} -> {sys.argv[2]}")
EOF
}

run_quantize() {  # INT4 W4A16 (RTN, symmetric, group 128) of the starting policy, once; CPU, a few minutes
  [[ -f $INT4_DIR/config.json ]] && return
  local src=$MERGED_DIR
  [[ -f $src/config.json ]] || src=$(run_download)   # no SFT: the base (then also set train.init_checkpoint='')
  $PY -m memexrl quantize --model "$src" --out "$INT4_DIR" --group-size 128
}

run_train() {  # GRPO; checkpoints every 10 steps in $RUN_DIR/checkpoints/step-N (adapter + trainer state)
  accelerate launch --config_file "$ACCEL" -m memexrl.cli train --config "$CONFIG" "$@" ${opts[@]+"${opts[@]}"} \
    ${overrides[@]+"${overrides[@]}"}
}

run_plot() { $PY -m memexrl plot "$RUN_DIR"; }

case $step in
  data) run_data ;;
  download) run_download ;;
  expert) run_data; run_expert ;;
  sft) run_data; run_sft ;;
  merge) run_merge ;;
  quantize) run_quantize ;;
  train) run_data; run_train ;;
  resume) run_data; run_train --resume ;;   # continues $RUN_DIR from its newest checkpoint (same config!)
  plot) run_plot ;;
  dirs) printf '%s\n' "EXPERT_DIR=$EXPERT_DIR" "SFT_DIR=$SFT_DIR" "MERGED_DIR=$MERGED_DIR" "INT4_DIR=$INT4_DIR" \
          "RUN_DIR=$RUN_DIR" "READING_TASKS=$READING_TASKS" ;;
  all)
    $PY -m memexrl train --config "$CONFIG" --dry-run   # the plan: batches, parameters, memory
    run_data; run_download; run_expert; run_sft; run_merge; run_quantize; run_train; run_plot ;;
  *) echo "unknown step '$step': data | download | expert | sft | merge | quantize | train | resume | plot | dirs | all" >&2
     exit 2 ;;
esac
# Resume after a crash or preemption: `bash launch/h200-lora.sh resume` (or `... train --resume-from
# runs/h200-lora/checkpoints/step-N`). A resumed run must use the same config and the same INT4 directory.
# Curves: runs/h200-lora/plots/*.png (`bash launch/h200-lora.sh plot`), wandb files in runs/h200-lora/wandb/.
