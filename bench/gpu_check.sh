#!/usr/bin/env bash
# One device run (issue 26): measured bf16 profiles on the GPU, micro-benchmarks for the device model, the CUDA
# test, and `ptplan run` on one GPU against its plan. Everything lands in OUTDIR/gpu_check.tar.gz (re-packed after
# every step, so a run cut short still returns what it finished) and OUTDIR/gpu_check.log.
#
#   bash bench/gpu_check.sh OUTDIR            on the GPU machine (device tool: OUTDIR=$OUT)
#   bash bench/gpu_check.sh OUTDIR cpu        a rehearsal on this CPU box with tiny models (same steps)
#
# Then, here: python bench/gpu_compare.py OUTDIR/gpu_check.tar.gz  (projection error, calibration, run error).
# PARTS (default "micro tests profiles run"; also "working") picks the parts; MODELS, BUDGET_SMALL/BUDGET_BIG (minutes per profile)
# and RUN_MODELS (the models run against their plan) override the defaults, e.g.
#   PARTS="tests run" RUN_MODELS="bert-base gpt2" bash bench/gpu_check.sh OUTDIR
set -u
PARTS=${PARTS:-micro tests profiles run}
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUTDIR=${1:?usage: bench/gpu_check.sh OUTDIR [cuda|cpu]}
DEV=${2:-cuda}
REPO=$(cd "$(dirname "$0")/.." && pwd)
W=/tmp/gpu_check
rm -rf "$W" && mkdir -p "$W/profiles" "$W/run/cache" "$OUTDIR"
exec > >(tee -a "$OUTDIR/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[$(date +%T) +${SECONDS}s] $*"; }
pack() { tar -C "$W" -czf "$OUTDIR/gpu_check.tar.gz.tmp" . && mv "$OUTDIR/gpu_check.tar.gz.tmp" "$OUTDIR/gpu_check.tar.gz"; }
step() {  # step SECONDS NAME CMD...: run with a time limit, log its status, re-pack
  local limit=$1 name=$2; shift 2
  log "start $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@"
  local rc=$?
  log "end $name rc=$rc"
  echo "$name $rc $SECONDS" >>"$W/steps.txt"
  pack
}

# ptplan importable without installing: a package folder of links (the device has torch, transformers, click,
# numpy; plotly travels as a wheel in .whl/ when present).
if ! python3 -c "import ptplan.cli.main" 2>/dev/null; then
  mkdir -p /tmp/pp/ptplan
  for d in planner executor cli profiles; do ln -sfn "$REPO/$d" "/tmp/pp/ptplan/$d"; done
  if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:/tmp/pp${PYTHONPATH:+:$PYTHONPATH}
fi
PT="python3 -m ptplan.cli.main"
cd "$REPO"

{
  date -u; uname -a; nvidia-smi 2>/dev/null || true
  python3 -c "import torch, transformers, click, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'numpy', numpy.__version__, 'gpu', torch.cuda.is_available() and \
torch.cuda.get_device_name(0))"
  git -C "$REPO" rev-parse HEAD 2>/dev/null || true
} >"$W/env.txt" 2>&1
cat "$W/env.txt"

if [ "$DEV" = cuda ]; then
  DT=bfloat16; TAG=h100; MODELS=${MODELS:-bert-base gpt2 vit-base bert-large llama-3.2-1b}
  BUDGET_SMALL=${BUDGET_SMALL:-0.4}; BUDGET_BIG=${BUDGET_BIG:-0.7}; RUN_MODELS=${RUN_MODELS:-bert-base}; BATCH=32; STEPS_PER_EPOCH=100
  MICRO=""
else
  DT=bfloat16; TAG=cpu; MODELS=${MODELS:-bert-tiny gpt2-tiny}; BUDGET_SMALL=0.1; BUDGET_BIG=0.1
  RUN_MODELS=${RUN_MODELS:-bert-tiny}; BATCH=8; STEPS_PER_EPOCH=6; MICRO="--quick"
fi

has micro && step 120 micro python3 bench/gpu_micro.py --device "$DEV" --dtype "$DT" $MICRO --out "$W/gpu_micro.json"
if [ "$DEV" = cuda ] && has tests; then
  step 150 cuda_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_profiler.py tests/test_cuda_run.py \
    --timeout 140 --junitxml "$W/cuda_tests.xml"
fi

# the backward's working set: the shipped measured profiles filled on this device (bench/profile_working.py, into
# $W/profiles, where run_model takes them from), and the live count against the CUDA allocator per layer
if [ "$DEV" = cuda ] && has working; then
  step 240 working_profiles python3 bench/profile_working.py --device cuda --out-dir "$W/profiles" \
    $(for m in ${WORKING_MODELS:-bert-base gpt2 vit-base bert-large llama-3.2-1b}; do echo "profiles/${m}_cuda_bf16.json"; done)
  step 150 working_layers python3 bench/backward_working.py --device cuda --dtype bfloat16 \
    --models ${WORKING_MODELS:-bert-base gpt2 vit-base bert-large llama-3.2-1b} --batch-sizes 8 32 --out "$W/backward_working.json"
fi

profile() {  # profile MODEL BUDGET
  local m=$1 budget=$2
  step 200 "profile_$m" $PT profile "$m" --device "$DEV" --dtype "$DT" --budget "$budget" --quiet \
    --out "$W/profiles/${m}_${TAG}_bf16.json"
}
set -- $MODELS
has profiles && profile "$1" "$BUDGET_SMALL"

# ptplan run on one device, K = 1, D = 1, freezing and AutoCache on, against the plan of the model's profile: the
# one measured or filled in this call, else the shipped measured one (MODEL_cuda_bf16), else the shipped projected one
if has run; then
  python3 - "$W/run/cluster.json" "$DEV" <<'EOF'
import json, sys
from ptplan.planner.cluster import PRESETS
c = PRESETS["dgx-h100"].to_json()
c.update(name="one-device", gpus_per_node=1, nics_per_node=1,
         notes="The lent machine: one GPU, K = 1, D = 1 (bench/gpu_check.sh).")
if sys.argv[2] == "cpu":
    c.update(PRESETS["cpu"].to_json(), name="one-device", gpus_per_node=1, nics_per_node=1)
json.dump(c, open(sys.argv[1], "w"), indent=1)
EOF
fi
run_model() {  # run_model MODEL: plan, run and compare in $W/run/MODEL (and without the AutoCache if the run failed)
  local m=$1 P R="$W/run/$1"
  mkdir -p "$R/cache"
  for P in "$W/profiles/${m}_${TAG}_bf16.json" "$W/profiles/${m}_${DEV}_bf16.json" "$REPO/profiles/${m}_${DEV}_bf16.json" \
           "$REPO/profiles/${m}_${TAG}_bf16.json"; do
    [ -f "$P" ] && break
  done
  [ -f "$P" ] || { log "no profile for $m"; return; }
  echo "$m $P" >>"$W/run/profiles_used.txt"
  step 60 "plan_$m" $PT plan "$P" --cluster "$W/run/cluster.json" --epochs 3 \
    --samples-per-epoch $((BATCH * STEPS_PER_EPOCH)) --batch "$BATCH" --freeze geometric --cache on --out "$R/plan.json"
  step 240 "run_$m" $PT run "$R/plan.json" --model "$m" --device "$DEV" --nproc-per-node 1 --no-progress \
    --log "$R/run.jsonl" --cache auto --cache-dir "$R/cache" --timeout 120
  step 60 "compare_$m" $PT compare "$R/plan.json" "$R/run.jsonl" --json "$R/compare.json"
  rm -rf "$R/cache"
  if [ "$(awk -v n="run_$m" '$1 == n {print $2}' "$W/steps.txt")" != 0 ]; then  # the same plan without the AutoCache
    step 60 "plan_nocache_$m" $PT plan "$P" --cluster "$W/run/cluster.json" --epochs 3 \
      --samples-per-epoch $((BATCH * STEPS_PER_EPOCH)) --batch "$BATCH" --freeze geometric --cache off \
      --out "$R/plan_nocache.json"
    step 240 "run_nocache_$m" $PT run "$R/plan_nocache.json" --model "$m" --device "$DEV" --nproc-per-node 1 \
      --no-progress --log "$R/run_nocache.jsonl" --cache off --timeout 120
    step 60 "compare_nocache_$m" $PT compare "$R/plan_nocache.json" "$R/run_nocache.jsonl" \
      --json "$R/compare_nocache.json"
  fi
}
if has run; then for m in $RUN_MODELS; do run_model "$m"; done; fi

shift
has profiles && for m in "$@"; do
  case $m in bert-large|llama-*) profile "$m" "$BUDGET_BIG" ;; *) profile "$m" "$BUDGET_SMALL" ;; esac
done
log "done"
pack
ls -la "$OUTDIR"
