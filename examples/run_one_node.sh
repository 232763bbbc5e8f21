#!/usr/bin/env bash
# Elastic pipelined training on one node: one process per GPU (NCCL), or CPU processes (gloo).
#
#   ptplan plan <profile.json> --cluster <preset> ... --out plan.json   # first
#   examples/run_one_node.sh                    # PLAN=plan.json MODEL=bert-base NPROC=4 by default
#   examples/run_one_node.sh --resume           # extra flags go to `ptplan run`
#
# NPROC must equal the plan's K*D (ptplan run refuses anything else before starting).
# The optimizer is the one the plan priced (ptplan plan --optimizer), at its default rate; LR=1e-4 sets another.
set -euo pipefail
PLAN=${PLAN:-plan.json}
MODEL=${MODEL:-bert-base}
NPROC=${NPROC:-4}
OUT=${OUT:-runs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
exec ptplan run "$PLAN" --model "$MODEL" --nproc-per-node "$NPROC" \
  ${LR:+--lr "$LR"} --weight-decay 0.01 \
  --checkpoint-dir "$OUT/ckpt" --checkpoint-every 500 --log "$OUT/run.jsonl" "$@"
# afterwards: ptplan compare "$PLAN" "$OUT/run.jsonl"
