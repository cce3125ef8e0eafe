#!/usr/bin/env bash
# Issue 19 on the H200: build the persistent layer kernel, run its GPU test, then
# persistent_bench.py once per plan (each process checks the plan's numerics before timing it and
# times cuBLAS beside it; a plan that deadlocks ends only its own process). Results under $OUT.
#   bash benchmarks/gpu/persistent_run.sh [--rows 64 176 512] [--experiments]
#   PLANS="128,164,128,128/1,1,1,1 32,82,32,64/4,2,4,2" bash benchmarks/gpu/persistent_run.sh ...
# BASE=DIR also builds DIR/persistent_layer.cu (with DIR/persistent_layer.h), an earlier kernel, and
# times it first with the same arguments, in its own processes (rows tagged kernel=$(basename DIR);
# the working tree's are kernel=tree). The device gets no git history, so make DIR here and carry
# it (build/ is ignored), e.g. round 11's kernel (commit a051858):
# (the kernel lived in omnigraph/workers/ops/csrc/ until round 13; a later one includes
# ../hopper_ptx.cuh, so put that beside DIR, e.g. build/hopper_ptx.cuh):
#   mkdir -p build/r11 && for f in persistent_layer.cu persistent_layer.h; do
#     git show a051858:omnigraph/workers/ops/csrc/$f > build/r11/$f; done
#   BASE=build/r11 bash benchmarks/gpu/persistent_run.sh ...      # run(carry=["build/r11"])
# BASE_PLANS (default: the first of PLANS) are the plans timed for BASE and for each variant.
# TREE_VARIANTS="NAME:-DFLAG=1,-DOTHER ..." also builds the working tree's source with those nvcc
# flags (name:flag,flag) and times each after the tree's build (rows tagged kernel=name).
set -u
OUT=${OUT:-/tmp/persistent-out}
mkdir -p "$OUT"
LIB=build/persistent/libpersistent.so
PLANS=${PLANS:-"64,132,64,128/2,1,2,1 64,164,64,128/2,1,2,1 64,132,64,132/2,1,2,1"}
BASE=${BASE:-}
BASE_PLANS=${BASE_PLANS:-${PLANS%% *}}
TREE_VARIANTS=${TREE_VARIANTS:-}
NVCC=/usr/local/cuda/bin/nvcc
FLAGS=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC,-fvisibility=hidden
       -Xptxas -v -shared --cudart static)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu.txt"

# builds, side by side: name, source, library, extra nvcc flags
build() {
  mkdir -p "$(dirname "$3")"
  "$NVCC" "${FLAGS[@]}" ${4:-} "$2" -o "$3" 2> "$OUT/ptxas-$1.txt"
}
kernels=(tree)
libs=("$LIB")
build tree benchmarks/gpu/persistent/persistent_layer.cu "$LIB" &
tree_build=$!
if [ -n "$BASE" ]; then
  base_name=$(basename "$BASE")
  [ -f "$BASE/persistent_layer.cu" ] || { echo "BASE=$BASE has no persistent_layer.cu (carry it)"; exit 1; }
  build "$base_name" "$BASE/persistent_layer.cu" "build/persistent-$base_name/libpersistent.so" &
  base_build=$!
  wait $base_build || { cat "$OUT/ptxas-$base_name.txt"; exit 1; }
  kernels=("$base_name" tree)
  libs=("build/persistent-$base_name/libpersistent.so" "$LIB")
fi
wait $tree_build || { cat "$OUT/ptxas-tree.txt"; exit 1; }
for v in $TREE_VARIANTS; do
  name=${v%%:*}
  build "$name" benchmarks/gpu/persistent/persistent_layer.cu "build/persistent-$name/libpersistent.so" \
    "$(echo "${v#*:}" | tr , ' ')" || { cat "$OUT/ptxas-$name.txt"; exit 1; }
  kernels+=("$name")
  libs+=("build/persistent-$name/libpersistent.so")
done
for i in "${!kernels[@]}"; do
  k=${kernels[$i]}
  echo "== $k: $(grep -E "stack|Used" "$OUT/ptxas-$k.txt" | tr -s ' ' | paste -sd ' ')" | tee -a "$OUT/ptxas.txt"
  sass=$(cuobjdump --dump-sass "${libs[$i]}" 2>/dev/null)  # disassembled once, counted three ways
  echo "SASS $k: $(grep -cE "HMMA" <<< "$sass") HMMA, $(grep -cE "UBLKCP" <<< "$sass") UBLKCP, $(grep -cE "LDS.128" <<< "$sass") LDS.128" | tee -a "$OUT/ptxas.txt"
done
# the clocks while the benchmark runs (read only)
( while sleep 1; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,clocks.mem,power.draw,clocks_throttle_reasons.active --format=csv,noheader; done > "$OUT/clocks.txt" 2>&1 ) &
CLOCKS=$!
# the GPU test builds the working tree's source itself
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/benchmarks/test_persistent_layer.py > "$OUT/pytest.txt" 2>&1
echo "gpu pytest rc=$? ($(tail -1 "$OUT/pytest.txt"))" | tee -a "$OUT/log.txt"
set -o pipefail
rc=0
want_experiments=0
args=()
for a in "$@"; do if [ "$a" = --experiments ]; then want_experiments=1; else args+=("$a"); fi; done
for i in "${!kernels[@]}"; do
  k=${kernels[$i]}
  plans=$PLANS
  [ "$k" != tree ] && plans=$BASE_PLANS
  p=0
  for plan in $plans; do
    extra=()
    if [ $p = 0 ] && [ $want_experiments = 1 ]; then extra=(--experiments); fi
    PYTHONUNBUFFERED=1 timeout 240 python3 benchmarks/gpu/persistent_bench.py --lib "${libs[$i]}" --kernel "$k" \
      --json "$OUT/part-$k-$p.json" --plans "$plan" "${args[@]}" "${extra[@]}" 2>&1 | tee -a "$OUT/log.txt"
    r=$?
    echo "kernel $k plan $plan: rc=$r" | tee -a "$OUT/log.txt"
    [ $r != 0 ] && rc=$r
    p=$((p + 1))
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for part in sorted(out.glob("part-*.json")):
    rows += json.loads(part.read_text())
    part.unlink()
(out / "persistent.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"{len(rows)} rows -> persistent.json")
# side by side: forward us per (case, plan, M) for each kernel, and each process's cuBLAS
table: dict = {}
for r in rows:
    if r["metric"] == "forward_us":
        table.setdefault((r["case"], r.get("variant", "-"), r["rows"]), {})[r.get("kernel", "?")] = r["value"]
kernels = sorted({r.get("kernel", "?") for r in rows}, key=lambda k: (k == "tree", k))
print(f"{'case':<36} {'plan':>24} {'M':>4}" + "".join(f"{k:>10}" for k in kernels))
for (case, plan, m), v in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
    print(f"{case:<36} {plan:>24} {m!s:>4}" + "".join(f"{v[k]:>10.1f}" if k in v else f"{'-':>10}" for k in kernels))
PY
kill $CLOCKS 2>/dev/null
echo "clocks during the run (sm MHz, max, mem MHz, W, throttle):"; sort -t, -k2 -n "$OUT/clocks.txt" | awk -F, '{print $2 $3 $5 $6}' | uniq -c | tail -8
exit $rc
