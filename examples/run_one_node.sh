#!/usr/bin/env bash
# Elastic pipelined training on one node: one process per GPU (NCCL), or CPU processes (gloo).
#
#   ptplan plan <profile.json> --cluster <preset> ... --out plan.json   # first
#   examples/run_one_node.sh                    # PLAN=plan.json MODEL=bert-base NPROC=4 by default
#   examples/run_one_node.sh --resume           # extra flags go to `ptplan run`; --resume continues the
#                                               # latest run folder (runs/*), or OUT=runs/<that one>
#
# NPROC must equal the plan's K*D (ptplan run refuses anything else before starting).
# The optimizer is the one the plan priced (ptplan plan --optimizer), at its default rate; LR=1e-4 sets another.
set -euo pipefail
PLAN=${PLAN:-plan.json}
MODEL=${MODEL:-bert-base}
NPROC=${NPROC:-4}
if [[ -z "${OUT:-}" && " $* " == *" --resume "* ]]; then  # continue the latest run folder, not a new one
  OUT=$(ls -d runs/*/ 2>/dev/null | sort | tail -n 1 || true)
  OUT=${OUT%/}
  if [[ -z "$OUT" ]]; then echo "error: --resume but no run folder in runs/; give OUT=<the run's folder>" >&2; exit 2; fi
  echo "resuming $OUT" >&2
fi
OUT=${OUT:-runs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
exec ptplan run "$PLAN" --model "$MODEL" --nproc-per-node "$NPROC" \
  ${LR:+--lr "$LR"} --weight-decay 0.01 \
  --checkpoint-dir "$OUT/ckpt" --checkpoint-every 500 --log "$OUT/run.jsonl" "$@"
# afterwards: ptplan compare "$PLAN" "$OUT/run.jsonl"
