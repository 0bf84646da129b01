#!/usr/bin/env bash
# One checkpoint, the five agents (memex, full, truncate, summary, m2) on the same ALFWorld games, then
# one comparison table and chart (memexrl eval compare). Agents run one after another; an agent whose
# OUT/AGENT/eval_alfworld.json exists (written last) is skipped, so an interrupted sweep goes on where it stopped.
#
#   bash launch/eval-agents.sh runs/sft runs/eval/sft                         # tiny-cpu, 20 valid_unseen games
#   CONFIG=configs/h200-lora.yaml SPLIT=valid GAMES=0 bash launch/eval-agents.sh runs/train runs/eval/grpo
#   AGENTS="memex truncate" bash launch/eval-agents.sh runs/sft runs/eval/sft rollout.max_new_tokens=256
# The m2 agent's insight bank comes from eval.insights_from (the config's; override it with
# eval.insights_from=runs/expert/demos.jsonl).
set -euo pipefail
CHECKPOINT=${1:?usage: eval-agents.sh CHECKPOINT OUT [section.key=value ...]}
OUT=${2:?usage: eval-agents.sh CHECKPOINT OUT [section.key=value ...]}
shift 2
CONFIG=${CONFIG:-configs/tiny-cpu.yaml}
SPLIT=${SPLIT:-valid_unseen}
GAMES=${GAMES:-20}
AGENTS=${AGENTS:-memex full truncate summary m2}
dirs=()
for agent in $AGENTS; do
  dirs+=("$OUT/$agent")
  if [[ -f "$OUT/$agent/eval_alfworld.json" ]]; then
    echo "$agent: done ($OUT/$agent/eval_alfworld.json)"
    continue
  fi
  memexrl eval alfworld --config "$CONFIG" --checkpoint "$CHECKPOINT" --split "$SPLIT" --games "$GAMES" \
    --agent "$agent" --out "$OUT/$agent" "$@"
done
memexrl eval compare "$OUT/compare" "${dirs[@]}"
