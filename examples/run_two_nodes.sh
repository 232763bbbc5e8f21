#!/usr/bin/env bash
# Elastic pipelined training on two nodes (c10d rendezvous). Run the same command on both nodes:
#
#   node A:  RDZV=nodeA.example:29400 JOB=job42 examples/run_two_nodes.sh
#   node B:  RDZV=nodeA.example:29400 JOB=job42 examples/run_two_nodes.sh
#
# 2 x NPROC must equal the plan's K*D. Global rank 0 writes the checkpoint into CKPT on whichever node
# it runs (c10d does not tie it to a node); on a restart (--max-restarts) every rank looks in its own
# CKPT and all resume from the newest checkpoint any node holds, so CKPT may be node-local or shared.
# The run log is written where global rank 0 runs; the workers' output goes to run.<host>-<pid>.workers.log.
# The optimizer is the one the plan priced (ptplan plan --optimizer), at its default rate; LR=1e-4 sets another.
set -euo pipefail
PLAN=${PLAN:-plan.json}
MODEL=${MODEL:-bert-base}
NPROC=${NPROC:-8}
RDZV=${RDZV:?set RDZV=host:port of the rendezvous (any one node)}
JOB=${JOB:-ptplan-$(date +%Y%m%d)}
CKPT=${CKPT:-runs/$JOB/ckpt}
exec ptplan run "$PLAN" --model "$MODEL" --nnodes 2 --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "$JOB" --max-restarts 3 \
  ${LR:+--lr "$LR"} --weight-decay 0.01 \
  --checkpoint-dir "$CKPT" --checkpoint-every 500 --log "runs/$JOB/run.jsonl" "$@"
