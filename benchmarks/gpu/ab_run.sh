#!/usr/bin/env bash
# Two trees side by side on the H200 machine: this tree (A) and an older one (B, a copy of its
# `omnigraph/` folder, e.g. `git archive REV omnigraph | tar -x -C .bench/before`), timed by this
# tree's benchmarks/laya_gpu.py in the order A, B, A, B on one machine in one run, since machines
# differ by 0.1-0.2 ms between sessions. Run after the onnxruntime-gpu join, carrying .whl,
# .gpu/ort-include and the old tree:
#
#   carry [.whl, .gpu/ort-include, .bench]   command: bash benchmarks/gpu/ab_run.sh   timeout_s 600
#
# First h200_run.sh builds the checkpoint and the fast bundle and runs A once ($OUT/A1); then
# laya_gpu.py alone for B, A, B ($OUT/B1, A2, B2), each with that tree first on PYTHONPATH (the
# servers and workers it starts inherit it). B may instead be this tree under other settings:
# B_ENV="NAME=VALUE ..." is B's environment, and BEFORE=. makes B this tree. Knobs: BEFORE
# (.bench/before), B_ENV (none), CASES (ort-fast-graph),
# LENGTHS (64), REQUESTS (300), and h200_run.sh's. A dry run on a CPU machine:
#   SIZE=tiny DEVICE=cpu CASES=ort-fp32 REQUESTS=5 bash benchmarks/gpu/ab_run.sh
set -u

REPO=$PWD
OUT=${OUT:-/tmp/ab-out}
BEFORE=${BEFORE:-$REPO/.bench/before}
B_ENV=${B_ENV:-}
CASES=${CASES:-ort-fast-graph}
LENGTHS=${LENGTHS:-64}
REQUESTS=${REQUESTS:-300}
SIZE=${SIZE:-full}
DEVICE=${DEVICE:-cuda}
WORK=${WORK:-/tmp/laya-gpu}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"

OUT=$OUT/A1 WORK=$WORK SITE=$SITE SIZE=$SIZE DEVICE=$DEVICE BUNDLES=fast CASES=$CASES REQUESTS=$REQUESTS BUDGET_S=240 HARD_LIMIT_S=300 \
  bash "$REPO/benchmarks/gpu/h200_run.sh" | tail -n 30

for run in B1 A2 B2; do
  tree=$REPO settings=()
  [[ $run == B* ]] && tree=$(cd "$BEFORE" && pwd) && read -r -a settings <<< "$B_ENV"
  echo "== $run: omnigraph from $tree ${settings[*]}"
  env "${settings[@]}" PYTHONPATH=$HOME/.ortgpu:$tree:$REPO:$SITE OMNIGRAPH_CACHE=$WORK/cache timeout -k 5 150 \
    python3 "$REPO/benchmarks/laya_gpu.py" --device "$DEVICE" --size "$SIZE" --checkpoint "$WORK/laya-$SIZE" --bundle fast="$WORK/bundle-fast" \
    --cases $CASES --lengths $LENGTHS --requests "$REQUESTS" --json "$OUT/$run.json" > "$OUT/$run.log" 2>&1
  echo "exit $?"
  PYTHONPATH=$REPO:$SITE python3 "$REPO/benchmarks/laya_gpu.py" --report "$OUT/$run.json" | sed -n '3,12p'
done
