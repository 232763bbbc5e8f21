#!/usr/bin/env bash
# One device run for the AutoCache fill path (docs/results.md: the lent H100's fill and refresh steps paid about
# 21.5 ms that no term priced). PARTS picks, in this order, each under its own time limit, everything under OUTDIR:
#   hostio  bench/profile_host_io.py fills measurement.host_io of the shipped measured CUDA profiles in place (the
#           runs below plan from them) and packs them into OUTDIR/host_io_profiles.tar.gz;
#   path    bench/fill_path.py on PATH_MODELS (the fill path taken apart; OUTDIR/fill_path.json);
#   check   bench/gpu_check.sh PARTS="$CHECK_PARTS" (default "working run": WORKING_MODELS' backward working set
#           filled on this device, then RUN_MODELS run against their plans with this tree; OUTDIR/gpu_check.*);
#   base    the first of RUN_MODELS run with the executor of a commit before the change under test (its files in
#           .base/executor: `git archive BASE executor | tar -x -C .base`), planner and CLI of this tree
#           (OUTDIR/base/gpu_check.*): the baseline, on the same machine in the same call;
#   tests   the CUDA tests (tests/test_cuda_run.py; OUTDIR/cuda_tests.log).
#
#   bash bench/gpu_fill.sh OUTDIR        (device tool: OUTDIR=$OUT; carry .whl, and .base for "base")
#   first run (2026-11-27, H200): PARTS="path check base tests" (the defaults below)
#   second run: PARTS="hostio path check" PATH_MODELS=bert-base CHECK_PARTS=run RUN_MODELS="bert-base gpt2"
set -u
OUTDIR=${1:?usage: bench/gpu_fill.sh OUTDIR}
PARTS=${PARTS:-path check base tests}
PATH_MODELS=${PATH_MODELS:-bert-base gpt2}
CHECK_PARTS=${CHECK_PARTS:-working run}
WORKING_MODELS=${WORKING_MODELS:-vit-base}
RUN_MODELS=${RUN_MODELS:-bert-base vit-base}
has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$OUTDIR/base"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log() { echo "[$(date +%T) +${SECONDS}s] $*"; }

# ptplan importable without installing (as gpu_check.sh does): this tree in /tmp/pp, BASE's executor in /tmp/ppbase
mkdir -p /tmp/pp/ptplan /tmp/ppbase/ptplan
for d in planner executor cli profiles; do ln -sfn "$REPO/$d" "/tmp/pp/ptplan/$d"; done
for d in planner cli profiles; do ln -sfn "$REPO/$d" "/tmp/ppbase/ptplan/$d"; done
ln -sfn "$REPO/.base/executor" /tmp/ppbase/ptplan/executor
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$REPO"/.whl/*.whl
fi
NEW=/tmp/site:/tmp/pp BASE=/tmp/site:/tmp/ppbase

if has hostio; then
  log "hostio: measurement.host_io of the measured CUDA profiles"
  PYTHONPATH=$NEW timeout -k 5 120 python3 bench/profile_host_io.py --device cuda profiles/*_cuda_bf16.json 2>&1 \
    | tee "$OUTDIR/host_io.log"
  tar -czf "$OUTDIR/host_io_profiles.tar.gz" profiles/*_cuda_bf16.json
  log "hostio done"
fi

if has path; then
  log "path: fill_path on $PATH_MODELS"
  PYTHONPATH=$NEW timeout -k 5 150 python3 bench/fill_path.py --device cuda --models $PATH_MODELS \
    --profiles $(for m in $PATH_MODELS; do echo "profiles/${m}_cuda_bf16.json"; done) --cache-root /tmp \
    --out "$OUTDIR/fill_path.json" 2>&1 | tee "$OUTDIR/fill_path.log"
  log "path done"
fi

if has check; then
  log "check: gpu_check.sh PARTS=\"$CHECK_PARTS\", this tree"
  PYTHONPATH=$NEW PARTS="$CHECK_PARTS" WORKING_MODELS="$WORKING_MODELS" RUN_MODELS="$RUN_MODELS" \
    timeout -k 5 330 bash bench/gpu_check.sh "$OUTDIR" >/dev/null 2>&1
  log "check rc=$? (log: gpu_check.log)"
  tail -40 "$OUTDIR/gpu_check.log"
fi

if has base && [ -d "$REPO/.base/executor" ]; then
  set -- $RUN_MODELS
  log "base: $1 run, BASE's executor"
  PYTHONPATH=$BASE PARTS="run" RUN_MODELS="$1" timeout -k 5 150 bash bench/gpu_check.sh "$OUTDIR/base" >/dev/null 2>&1
  log "base rc=$?"
  tail -25 "$OUTDIR/base/gpu_check.log"
fi

if has tests; then
  log "tests: CUDA tests"
  PYTHONPATH=$NEW timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_run.py \
    --timeout 230 >"$OUTDIR/cuda_tests.log" 2>&1
  log "tests rc=$?"
  tail -15 "$OUTDIR/cuda_tests.log"
fi
log "done"
