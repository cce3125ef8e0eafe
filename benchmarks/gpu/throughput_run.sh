#!/usr/bin/env bash
# Issue 9 on the H200 machine: the full synthetic checkpoint, its `fast` bundle, then
# benchmarks/throughput.py --device cuda (omnigraph batching off / on at c = 1, 8, 32, 64, beside
# laya-cuda's BatchEngine and laya's predict_batch of 64, in the same run).
#
# Run on the GPU machine from the repository root, after the onnxruntime-gpu join of
# ../shared/gpu/README.md has installed it into $HOME/.ortgpu (same warm machine), with `.whl`
# (benchmarks/gpu/fetch_wheels.sh) and `.gpu/ort-include` (the ORT headers) carried, exactly as
# benchmarks/gpu/h200_run.sh is run (its header lists the four join runs):
#
#   run 5  carry [.whl, .gpu/ort-include]   command: bash benchmarks/gpu/throughput_run.sh   timeout_s 600
#
# (On 2026-11-29 the tree had grown to 2 MiB, so a 62 MiB part of .gpu/ortgpu no longer fitted in
# one call: the same wheel was carried in five 52 MB parts, `split -b 52000000`, joined the same way.)
#
# Writes $OUT/throughput.json (rows + targets, rewritten after every case) and $OUT/throughput.log
# (every step's output), and prints the report last. A failed step is logged and the run goes on;
# the benchmark skips, with the reason, whatever that step left missing.
#
# Steps and expected wall time on the H200 machine (16 cores), about 6 minutes in all:
#   1. install the carried wheels into $SITE                                   ~5 s
#   2. the op library (nvcc, sm_90a) and the full checkpoint, side by side     ~45 s
#   3. the fast bundle (export + ORT CPU validation)                          ~1.5 min
#   4. throughput.py: omnigraph off and on (2 loads, 8 points of 1 + 5 s),
#      laya-cuda (load, 4 points), laya predict_batch (load, 1 point), host   ~3.5 min
# The benchmark is stopped at HARD_LIMIT_S (580 s) from the start; a case cut off still leaves the
# earlier cases' JSON, and this script then prints the report from it.
#
# Knobs (environment): OUT (default /tmp/throughput-out), WORK (/tmp/throughput-gpu), SITE
# (/tmp/site), SECONDS_PER_POINT (5), HARD_LIMIT_S (580), REPLICAS (1: omnigraph's worker
# replicas; 2 gave +8% at c=64 in a probe, the GPU then being busier), and for a dry run on a CPU machine
# SIZE (full), DEVICE (cuda), FAST (1: the fast bundle; 0: the fp32 one, which needs no nvcc):
#   SIZE=tiny DEVICE=cpu FAST=0 SECONDS_PER_POINT=1 bash benchmarks/gpu/throughput_run.sh
set -u

START=$(date +%s)
HARD_LIMIT_S=${HARD_LIMIT_S:-580}
SIZE=${SIZE:-full}
DEVICE=${DEVICE:-cuda}
FAST=${FAST:-1}
SECONDS_PER_POINT=${SECONDS_PER_POINT:-5}
REPLICAS=${REPLICAS:-1}
SITE=${SITE:-/tmp/site}
REPO=$PWD
OUT=${OUT:-/tmp/throughput-out}
WORK=${WORK:-/tmp/throughput-gpu}
LOG=$OUT/throughput.log
JSON=$OUT/throughput.json
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# 1. wheels (laya-cuda with no dependencies: it runs on the machine's cupy-cuda13x)
if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
  step wheels python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$REPO"/.whl/*.whl
else
  log "no .whl folder carried: using the interpreter's own packages"
fi
if [[ $DEVICE == cuda ]]; then
  if ! step cuda-session python3 -c 'import onnxruntime as ort; ort.preload_dlls(); import sys
sys.exit("CUDAExecutionProvider" not in ort.get_available_providers())'; then
    nvidia_loader_path
    log "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  fi
fi

# 2-3. checkpoint and bundle, unless an earlier run on this warm machine left them in $WORK
# (WORK=/tmp/laya-gpu after benchmarks/gpu/h200_run.sh, whose checkpoint and bundles are the same)
CHECKPOINT=$WORK/laya-$SIZE
if [[ $FAST == 1 ]]; then
  BUNDLE_NAME=fast; FLAGS=(--precision bf16 --fast)
else
  BUNDLE_NAME=fp32; FLAGS=(--precision fp32)
fi
BUNDLE=$WORK/bundle-$BUNDLE_NAME
if [[ -f $CHECKPOINT/model.safetensors && -f $BUNDLE/manifest.json ]]; then
  log "reusing $CHECKPOINT and $BUNDLE"
else
  # the op library (the fast bundle's custom ops) and the checkpoint, side by side
  if [[ $FAST == 1 ]]; then
    ( step ops-build python3 -m omnigraph.plugin.cli --debug ops build --arch 90a --out "$WORK/ops" ) &
    OPS_PID=$!
  fi
  step synth python3 -m omnigraph.plugin.cli --debug bundle synth laya --size "$SIZE" --seed 0 --out "$CHECKPOINT"
  [[ $FAST == 1 ]] && wait $OPS_PID
  step "bundle-$BUNDLE_NAME" timeout 300 python3 -m omnigraph.plugin.cli --debug bundle build laya \
    --checkpoint "$CHECKPOINT" --out "$BUNDLE" "${FLAGS[@]}"
fi

# 4. the benchmark, stopped at HARD_LIMIT_S so that the report below still prints inside the run
STOP=$(( HARD_LIMIT_S - $(elapsed) ))
(( STOP < 1 )) && STOP=1  # `timeout 0` would mean no limit
log "== throughput.py, stopped after $STOP s"
timeout -k 5 "$STOP" python3 benchmarks/throughput.py --device "$DEVICE" --size "$SIZE" \
  --checkpoint "$CHECKPOINT" --bundle "$BUNDLE_NAME=$BUNDLE" \
  --seconds "$SECONDS_PER_POINT" --warmup-s 1 --replicas "$REPLICAS" --json "$JSON" >> "$LOG" 2>&1
log "== throughput.py: exit $?"

echo
if [[ -f $JSON ]]; then
  python3 benchmarks/throughput.py --report "$JSON"
else
  echo "no $JSON: the last 40 lines of the log"
  tail -n 40 "$LOG"
fi
