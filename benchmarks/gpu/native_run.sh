#!/usr/bin/env bash
# Issue 23 on the GPU machine: Cua-S1 and Open-Jev through vLLM's GPU build (benchmarks/native_gpu.py).
#
# Run on the GPU machine from the repository root, after benchmarks/gpu/vllm_join.sh has installed
# vLLM 0.26.0 into $HOME/.vllmgpu/site (same warm machine), with `.whl` (benchmarks/gpu/fetch_wheels.sh:
# omnigraph's own wheel, for its entry points, and posix_ipc) carried. benchmarks/gpu/fetch_vllm.sh
# prints the whole sequence; after the join's calls, one call per phase, back to back:
#
#   run J+1  carry [.whl]  command: PHASE=build bash benchmarks/gpu/native_run.sh      timeout_s 600
#   run J+2  carry [.whl]  command: PHASE=cua_s1 bash benchmarks/gpu/native_run.sh     timeout_s 600
#   run J+3  carry [.whl]  command: PHASE=open_jev bash benchmarks/gpu/native_run.sh   timeout_s 600
#
# Phases (PHASE; `all` runs them in order in one call, as the CPU dry run does):
#   build     install .whl into $SITE; preflight (vllm, flashinfer, torch, the pipelines import);
#             the two synthetic checkpoints and their bundles, side by side, into $WORK/cache
#             (Cua-S1 at Qwen3-4B dimensions: 14.5 GB of float32 weights written, merged, hashed;
#             Open-Jev at Qwen3-1.7B dimensions: 5.6 GB)                          est. 4-6 min
#   cua_s1    native_gpu.py --models cua_s1: transformers (bf16 timed, then the fp32 reference),
#             then omnigraph (vLLM start with torch.compile and CUDA graphs, batch-1 latency and
#             closed loops at c = 1, 8, 32, for 1 and 8 questions)                 est. 5-8 min
#   open_jev  the same for Open-Jev                                                 est. 4-6 min
# Each benchmark phase writes $WORK/results/native_gpu-MODEL.json (kept on the warm machine) and, at its end,
# every model's rows so far to $OUT/native_gpu.json; the log of the call is $OUT/native_gpu.log.
# No case starts after BUDGET_S (480 s) from the call's start, and the benchmark is stopped at
# HARD_LIMIT_S (570 s), so that the report still prints inside the 600 s a call may run; a case cut
# off keeps the rows it wrote (omnigraph's after every concurrency point).
#
# Knobs (environment): PHASE (all), MODELS ("cua_s1 open_jev"), OUT (/tmp/native-gpu-out; the device call's own $OUT), WORK
# (/tmp/native-gpu: checkpoints, bundles, per-model JSON), SITE (/tmp/site), PYTHON (python3),
# REQUESTS (100 timed batch-1 requests per case and question count), SECONDS_PER_POINT (5),
# CASES (transformers omnigraph vllm: vllm is the stage's engine alone, what the pipeline adds is the difference),
# CONCURRENCY (1 8 32), ENGINE_ARGS (a JSON object of more vLLM engine arguments, native_gpu.py's
# --engine-args) with LABEL naming that variant: its rows go to $WORK/results-LABEL and
# $OUT/native_gpu-LABEL.json, apart from the default's,
# BUDGET_S, HARD_LIMIT_S, and for a dry run on a CPU machine SIZE (real) and DEVICE (cuda):
#   SIZE=tiny DEVICE=cpu PYTHON=.venv/bin/python REQUESTS=3 SECONDS_PER_POINT=1 bash benchmarks/gpu/native_run.sh
set -u

START=$(date +%s)
PHASE=${PHASE:-all}
SIZE=${SIZE:-real}
DEVICE=${DEVICE:-cuda}
REQUESTS=${REQUESTS:-100}
SECONDS_PER_POINT=${SECONDS_PER_POINT:-5}
BUDGET_S=${BUDGET_S:-480}
HARD_LIMIT_S=${HARD_LIMIT_S:-570}
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
REPO=$PWD
OUT=${OUT:-/tmp/native-gpu-out}
WORK=${WORK:-/tmp/native-gpu}
ENGINE_ARGS=${ENGINE_ARGS:-"{}"}
LABEL=${LABEL:+-$LABEL}
LOG=$OUT/native_gpu$LABEL.log
JSON=$OUT/native_gpu$LABEL.json
RESULTS=$WORK/results$LABEL  # this variant's per-model JSON
read -r -a MODELS <<< "${MODELS:-cua_s1 open_jev}"  # the models `build` and `all` take
read -r -a CASES <<< "${CASES:-transformers omnigraph vllm}"
read -r -a CONCURRENCY <<< "${CONCURRENCY:-1 8 32}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# vLLM's site and the CuTe DSL's folder in it, as benchmarks/gpu/vllm_join.sh wrote them (none on a CPU machine)
[[ -f $HOME/.vllmgpu/pythonpath ]] && export PYTHONPATH=$(cat "$HOME/.vllmgpu/pythonpath"):$PYTHONPATH

phase_build() {
  if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
    step wheels "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$REPO"/.whl/*.whl
  else
    log "no .whl folder carried: using the interpreter's own packages"
  fi
  if ! step preflight "$PYTHON" - "$DEVICE" <<'EOF'
import sys
import torch
import vllm
print("vllm", vllm.__version__, vllm.__file__)
print("torch", torch.__version__, torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else "cpu")
if sys.argv[1] == "cuda":
    import flashinfer
    print("flashinfer", flashinfer.__version__)
from omnigraph.pipelines.registry import get_pipeline
print("pipelines", [get_pipeline(name).model_type for name in ("cua_s1", "open_jev")])
EOF
  then
    log "preflight failed: vLLM or the pipelines do not import (see $LOG); nothing else can run"
    return 1
  fi
  local pids=()
  for model in "${MODELS[@]}"; do
    ( step "build-$model" timeout 540 "$PYTHON" benchmarks/native_gpu.py --build-only --models "$model" \
        --size "$SIZE" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  du -sh "$WORK"/cache/* >> "$LOG" 2>&1
  df -h "$WORK" "$HOME" >> "$LOG" 2>&1  # the machine has 64 GiB of disk; the real sizes take about 41 GB
}

phase_model() {
  local model=$1
  mkdir -p "$RESULTS"
  local left=$(( BUDGET_S - $(elapsed) ))
  local stop=$(( HARD_LIMIT_S - $(elapsed) ))
  (( stop < 1 )) && stop=1  # `timeout 0` would mean no limit
  log "== native_gpu.py --models $model with --time-budget $left, stopped after $stop s"
  timeout -k 5 "$stop" "$PYTHON" benchmarks/native_gpu.py --device "$DEVICE" --size "$SIZE" --models "$model" \
    --cases "${CASES[@]}" --concurrency "${CONCURRENCY[@]}" --requests "$REQUESTS" --seconds "$SECONDS_PER_POINT" --time-budget "$left" \
    --engine-args "$ENGINE_ARGS" --json "$RESULTS/native_gpu-$model.json" >> "$LOG" 2>&1
  log "== native_gpu.py --models $model: exit $?"
  # A vLLM engine process left behind (a run stopped at HARD_LIMIT_S) would hold GPU memory from the next phase.
  [[ $DEVICE == cuda ]] && nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv >> "$LOG" 2>&1
}

case $PHASE in
  build) phase_build ;;
  cua_s1|open_jev) phase_model "$PHASE" ;;
  all) phase_build && for model in "${MODELS[@]}"; do phase_model "$model"; done ;;
  *) log "unknown PHASE $PHASE (build, cua_s1, open_jev, all)"; exit 2 ;;
esac

echo
if compgen -G "$RESULTS/native_gpu-*.json" > /dev/null; then
  "$PYTHON" -c 'import json, sys
rows = [row for path in sys.argv[2:] for row in json.load(open(path))]
json.dump(rows, open(sys.argv[1], "w"), indent=2)' "$JSON" "$RESULTS"/native_gpu-*.json
  "$PYTHON" benchmarks/native_gpu.py --report "$JSON"
else
  echo "no benchmark JSON in $RESULTS yet: the last 40 lines of the log"
  tail -n 40 "$LOG"
fi
