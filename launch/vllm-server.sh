#!/usr/bin/env bash
# A vLLM OpenAI-compatible server for rollouts (rollout.vllm_server_url), serving the INT4 W4A16 checkpoint of
# `memexrl quantize` with runtime LoRA loading, so that the trainer can push each new adapter version
# (rollout/vllm.py: /v1/load_lora_adapter, then /v1/unload_lora_adapter of the previous one).
#
#   bash launch/vllm-server.sh                          # MODEL=runs/qwen3-30b-a3b-int4, port 8000, 1 GPU
#   MODEL=/shared/int4 PORT=8001 GPUS=0,1 TP=2 bash launch/vllm-server.sh
# Then train with: memexrl train --config configs/h200-lora.yaml rollout.vllm_server_url=http://HOST:PORT
#   (rollout.vllm_model must be the same string as MODEL: it is the served model name the trainer asks for).
# Config it serves: configs/h200-lora.yaml (rollout.vllm_model, train.lora_r, rollout.max_context_tokens).
#
# GPU memory (per server, before tensor parallelism): INT4 weights 15.5 GiB (29.9B decoder-linear params at
# 4 bits + a bf16 scale per 128; router, norms, embeddings and lm_head bf16, 1.3 GB), LoRA slots for one
# rank-16 adapter on q/k/v/o (13.4M params, < 0.1 GiB), activations/CUDA graphs ~2-4 GiB, and the KV cache
# in the rest of GPU_MEM_UTIL x the GPU: 96 KiB per token (48 layers x K,V x 4 kv heads x 128 x bf16), so on
# one H200 at 0.90 (~125 GiB) ~105 GiB of KV = ~1.1M tokens = ~35 full 32K contexts or ~150 episodes at 7K.
# On an 80 GB GPU at 0.90: ~50 GiB of KV (~540K tokens).
#
# Limits of server mode in this code base (rollout/vllm.py), stated honestly:
# - Full fine-tuning: start with FULL_SYNC=1 (VLLM_SERVER_DEV_MODE=1 and our worker extension): each sync
#   writes the weights as safetensors buckets next to the adapters and the workers load them through
#   /collective_rpc. Dev mode exposes control endpoints: keep the port on the cluster's private network.
# - The adapter directory must be readable by the server: the trainer writes it under $TMPDIR (Python's
#   tempfile); on another machine point TMPDIR at a shared filesystem on the trainer's side.
# - Several training processes may share a server: each engine loads its adapters under its own names
#   (policy-<pid>-<random>-vN; tests/test_vllm_engine.py runs two against one vllm serve). Each process holds
#   two versions for a moment (the new loads before the old unloads): MAX_LORAS >= 2 x processes.
# - --logprobs-mode raw_logprobs (the trainer compares raw log-probs, before temperature) exists in vLLM
#   >= 0.10.2 and is its default in recent versions; set LOGPROBS_MODE= (empty) for older versions.
# Not verified here: written on a CPU machine; flags checked against vLLM 0.32's engine arguments.
trap '' USR1   # the trainer's preemption notice (common/preemption.py), which SLURM sends to every process of a job
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-runs/qwen3-30b-a3b-int4}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.90}
MAX_LORA_RANK=${MAX_LORA_RANK:-16}        # >= train.lora_r; vLLM accepts 1, 8, 16, 32, 64, 128, 256, ...
MAX_LORAS=${MAX_LORAS:-2}                 # >= 2 x the training processes using this server
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32768}     # = rollout.max_context_tokens (the paper's 32K window)
TP=${TP:-1}                               # tensor parallel GPUs (INT4 30B fits one GPU)
LOGPROBS_MODE=${LOGPROBS_MODE-raw_logprobs}
[[ -n "${GPUS:-}" ]] && export CUDA_VISIBLE_DEVICES=$GPUS

if [[ ! -f $MODEL/config.json ]]; then
  echo "no checkpoint in $MODEL: run memexrl quantize --model <bf16 start> --out $MODEL first" >&2
  exit 2
fi

export VLLM_ALLOW_RUNTIME_LORA_UPDATING=1  # enables /v1/load_lora_adapter and /v1/unload_lora_adapter
args=(
  "$MODEL"
  --served-model-name "$MODEL"
  --host "$HOST" --port "$PORT"
  --dtype bfloat16
  --max-model-len "$MAX_MODEL_LEN"
  --gpu-memory-utilization "$GPU_MEM_UTIL"
  --tensor-parallel-size "$TP"
  --enable-lora --max-lora-rank "$MAX_LORA_RANK" --max-loras "$MAX_LORAS"   # a new adapter loads before the old unloads
  --enable-prefix-caching                                        # turns of an episode share their prefix
)
[[ -n $LOGPROBS_MODE ]] && args+=(--logprobs-mode "$LOGPROBS_MODE")
if [[ ${FULL_SYNC:-0} == 1 ]]; then  # full-weight sync from the trainer (rollout/vllm.py), needs memexrl here
  export VLLM_SERVER_DEV_MODE=1
  args+=(--worker-extension-cls rollout.vllm.WorkerWeightSync)
fi
echo "vLLM server: $MODEL on http://$HOST:$PORT (rollout.vllm_server_url=http://$(hostname):$PORT)"
exec vllm serve "${args[@]}" "$@"
