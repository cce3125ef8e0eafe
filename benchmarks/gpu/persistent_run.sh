#!/usr/bin/env bash
# Issue 19 on the H200: build the persistent layer kernel, run its GPU test, then
# persistent_bench.py once per plan (each process checks the plan's numerics before timing it and
# times cuBLAS beside it; a plan that deadlocks ends only its own process). Results under $OUT.
#   bash benchmarks/gpu/persistent_run.sh [--rows 64 176 512] [--experiments]
#   PLANS="128,164,128,128/1,1,1,1 32,82,32,64/4,2,4,2" bash benchmarks/gpu/persistent_run.sh ...
set -u
OUT=${OUT:-/tmp/persistent-out}
mkdir -p "$OUT"
LIB=build/persistent/libpersistent.so
PLANS=${PLANS:-"64,132,64,128/2,1,2,1 64,164,64,128/2,1,2,1 64,132,64,132/2,1,2,1"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"
mkdir -p build/persistent
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC,-fvisibility=hidden \
  -Xptxas -v -shared --cudart static omnigraph/workers/ops/csrc/persistent_layer.cu -o "$LIB" 2> "$OUT/ptxas.txt" || {
  cat "$OUT/ptxas.txt"; exit 1; }
grep -E "stack|Used" "$OUT/ptxas.txt"
echo "SASS: $(cuobjdump --dump-sass "$LIB" 2>/dev/null | grep -cE "HMMA") HMMA, $(cuobjdump --dump-sass "$LIB" 2>/dev/null | grep -cE "UBLKCP") UBLKCP" | tee -a "$OUT/ptxas.txt"
# the clocks while the benchmark runs (read only)
( while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,clocks_throttle_reasons.active --format=csv,noheader; done > "$OUT/clocks.txt" 2>&1 ) &
CLOCKS=$!
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_persistent_layer.py > "$OUT/pytest.txt" 2>&1
echo "gpu pytest rc=$? ($(tail -1 "$OUT/pytest.txt"))" | tee -a "$OUT/log.txt"
set -o pipefail
rc=0
want_experiments=0
args=()
for a in "$@"; do if [ "$a" = --experiments ]; then want_experiments=1; else args+=("$a"); fi; done
i=0
for plan in $PLANS; do
  extra=()
  if [ $i = 0 ] && [ $want_experiments = 1 ]; then extra=(--experiments); fi
  PYTHONUNBUFFERED=1 timeout 240 python3 benchmarks/gpu/persistent_bench.py --lib "$LIB" --json "$OUT/part-$i.json" \
    --plans "$plan" "${args[@]}" "${extra[@]}" 2>&1 | tee -a "$OUT/log.txt"
  r=$?
  echo "plan $plan: rc=$r" | tee -a "$OUT/log.txt"
  [ $r != 0 ] && rc=$r
  i=$((i + 1))
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for part in sorted(out.glob("part-*.json")):
    rows += json.loads(part.read_text())
    part.unlink()
(out / "persistent.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{len(rows)} rows -> persistent.json")
EOF
kill $CLOCKS 2>/dev/null
echo "clocks during the run (sm MHz, max, mem MHz, W, throttle):"; sort -t, -k2 -n "$OUT/clocks.txt" | awk -F, '{print $2 $3 $5 $6}' | uniq -c | tail -8
exit $rc
