#!/usr/bin/env bash
# Issue 19, step 1, on the H200: build (or take the carried build of) the persistent layer kernel
# and run persistent_bench.py; results and log under $OUT.
#   bash benchmarks/gpu/persistent_run.sh [persistent_bench.py args...]
set -u
OUT=${OUT:-/tmp/persistent-out}
mkdir -p "$OUT"
LIB=build/persistent/libpersistent.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
if ! python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1])" "$LIB" 2>/dev/null; then
  mkdir -p build/persistent
  /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC,-fvisibility=hidden \
    -shared --cudart static omnigraph/workers/ops/csrc/persistent_layer.cu -o "$LIB" || exit 1
fi
cuobjdump --dump-sass "$LIB" 2>/dev/null | grep -cE "HMMA|UBLKCP|SYNCS" > "$OUT/sass_counts.txt" || true
# the clocks while the benchmark runs (read only)
( while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,clocks_throttle_reasons.active --format=csv,noheader; done > "$OUT/clocks.txt" 2>&1 ) &
CLOCKS=$!
set -o pipefail
PYTHONUNBUFFERED=1 timeout 480 python3 benchmarks/gpu/persistent_bench.py --lib "$LIB" --json "$OUT/persistent.json" "$@" 2>&1 | tee "$OUT/log.txt"
rc=$?
kill $CLOCKS 2>/dev/null
echo "clocks during the run (sm MHz, max, mem MHz, W, throttle):"; sort -t, -k2 -n "$OUT/clocks.txt" | awk -F, '{print $2 $3 $5 $6}' | uniq -c | tail -8
exit $rc
