#!/usr/bin/env bash
# The LME-V2 reader (and judge) of the real protocol: vLLM serving Qwen3.5-9B behind an OpenAI-compatible API
# (lme-v2.md "Reader and prompt": temperature 0.6, top_p 0.95, top_k 20, up to 20,000 completion tokens, thinking
# on; those are `memexrl eval lme`'s defaults for a URL reader, eval/lme/llm.py READER_SAMPLING).
#
#   bash launch/lme-reader.sh                       # Qwen/Qwen3.5-9B on GPU 0, port 8100
#   MODEL=/shared/qwen3.5-9b GPUS=1 PORT=8101 bash launch/lme-reader.sh
# Then, with the dataset downloaded to data/lme-v2 (huggingface-cli download xiaowu0162/longmemeval-v2 --repo-type dataset):
#   memexrl eval lme --data data/lme-v2 --haystack small --memory rag \
#       --reader http://localhost:8100/v1 --judge http://localhost:8100/v1 --out runs/lme/rag-small
#   memexrl eval lme --data data/lme-v2 --haystack small --memory memex --checkpoint runs/train \
#       --config configs/h200-lora.yaml --reader http://localhost:8100/v1 --judge http://localhost:8100/v1
#   memexrl lme lafs runs/lme/rag-small runs/lme/memex-small
# The 200K-token memory budget is counted with the reader's own tokenizer (--reader-tokenizer, default: the
# served model's name, loaded with transformers). Memory: Qwen3.5-9B in bf16 is ~18 GiB; a 200K-token context
# needs the rest of an 80 GB GPU for its KV cache (MAX_MODEL_LEN below); one H200 serves reader and judge.
# Not verified here: written on a CPU machine; flags checked against vLLM 0.32's engine arguments.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3.5-9B}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8100}
GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.90}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-262144}   # 200K memory context + question + 20K answer
TP=${TP:-1}
[[ -n "${GPUS:-}" ]] && export CUDA_VISIBLE_DEVICES=$GPUS
exec vllm serve "$MODEL" --host "$HOST" --port "$PORT" --dtype bfloat16 \
  --max-model-len "$MAX_MODEL_LEN" --gpu-memory-utilization "$GPU_MEM_UTIL" --tensor-parallel-size "$TP" \
  --enable-prefix-caching --reasoning-parser qwen3
