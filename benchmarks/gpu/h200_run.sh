#!/usr/bin/env bash
# Issue 7 on the H200 machine: build everything there, then run benchmarks/laya_gpu.py.
#
# Run on the GPU machine from the repository root, after the onnxruntime-gpu join of
# ../shared/gpu/README.md has installed it into $HOME/.ortgpu (same warm machine), with `.whl`
# (benchmarks/gpu/fetch_wheels.sh) and `.gpu/ort-include` (the ORT headers) carried:
#
#   bash benchmarks/gpu/h200_run.sh
#
# The device calls, back to back (the machine is given back after ~30 s idle), each within the
# 64 MiB a call carries (tree ~1 MiB, .whl 4.3 MiB, ort-include 0.5 MiB, a part <= 63 MiB):
#   run 1-3  carry [.gpu/ortgpu/pN, .gpu/join.sh]   command: bash .gpu/join.sh N
#   run 4    carry [.gpu/ortgpu/p3, .gpu/join.sh]   command: bash .gpu/join.sh 3
#   run 5    carry [.whl, .gpu/ort-include]        command: bash benchmarks/gpu/h200_run.sh
#            timeout_s 600
#
# Writes $OUT/laya_gpu.json (rows + targets, rewritten after every case) and $OUT/laya_gpu.log
# (every step's output), and prints the compact report last. Each step's failure is logged and the
# run goes on; the benchmark skips, with the reason, whatever a failed step left missing.
#
# Steps and expected wall time on the H200 machine (16 cores), about 8 minutes in all:
#   1. install the carried wheels into $SITE                              ~5 s
#   2. preflight: a torch-free CUDA session, versions, providers, imports ~15 s
#   3. op library (nvcc, sm_90a) and the full synthetic checkpoint,
#      side by side (here, on a busy 2-core machine: 51 s and 46-106 s)   ~45 s
#   4. the bf16, fast and fp32 bundles of that checkpoint, side by side
#      (export + ORT CPU validation each; the bf16 one took 7.3 min here
#      on a busy 2-core machine, of which 1.8 min CPU)                    ~2 min
#   5. laya_gpu.py: laya (~45 s), laya-cuda (~15 s), then ort-fast-graph,
#      ort-fast, ort-bf16, ort-fp32 (~45 s each: two loads, 3 x 220 calls) ~4.5 min
# The benchmark gets --time-budget so that no case starts after about 8.5 minutes from the start
# (BUDGET_S, default 510 s), and is stopped at HARD_LIMIT_S (580 s); a case cut off still leaves
# the earlier cases' JSON, and this script then prints the report from it.
#
# Knobs (environment): OUT (default /tmp/laya-gpu-out), WORK (/tmp/laya-gpu), SITE (/tmp/site),
# BUDGET_S, BUNDLES ("bf16 fast fast16 fp32": drop fp32, the last case, to save build time), CASES
# (a subset of laya_gpu.py's cases, e.g. "laya ort-fast-graph ort-fast16-graph"), and for a
# dry run on a CPU machine SIZE (full), DEVICE (cuda), REQUESTS (200):
#   SIZE=tiny DEVICE=cpu REQUESTS=3 bash benchmarks/gpu/h200_run.sh
set -u

START=$(date +%s)
BUDGET_S=${BUDGET_S:-510}
HARD_LIMIT_S=${HARD_LIMIT_S:-580}
SIZE=${SIZE:-full}
DEVICE=${DEVICE:-cuda}
REQUESTS=${REQUESTS:-200}
SITE=${SITE:-/tmp/site}
BUNDLES=${BUNDLES:-bf16 fast fast16 fp32}
CASES=${CASES:-}  # laya_gpu.py's --cases (empty: all of them)
REPO=$PWD
OUT=${OUT:-/tmp/laya-gpu-out}
WORK=${WORK:-/tmp/laya-gpu}
LOG=$OUT/laya_gpu.log
JSON=$OUT/laya_gpu.json
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# 1. wheels (laya-cuda with no dependencies: it runs on the machine's cupy-cuda13x)
step wheels python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$REPO"/.whl/*.whl

# 2. preflight. The graph workers do not import torch: they load the CUDA 13 / cuDNN 9 libraries
# of the machine's nvidia-* packages with onnxruntime.preload_dlls(). Check that a torch-free
# process gets a CUDA session; if not, put those libraries on the loader path of every process.
cuda_session_check() {
  python3 - <<'EOF'
import onnxruntime as ort
from onnx import TensorProto, helper
ort.preload_dlls()
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
options = ort.SessionOptions()
options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
print("torch-free CUDA session:", session.get_providers())
EOF
}
if ! step cuda-session cuda_session_check; then
  nvidia_loader_path
  log "preload_dlls was not enough: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  step cuda-session-with-loader-path cuda_session_check
fi

step preflight python3 - <<'EOF'
import importlib, importlib.metadata as md
import torch
print("torch", torch.__version__, torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
import onnxruntime as ort
print("onnxruntime", ort.__version__, ort.__file__, ort.get_available_providers())
for dist in ("laya", "laya-cuda", "cupy-cuda13x", "pydantic", "omnigraph", "transformers"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "MISSING")
for module in ("laya", "laya_cuda", "laya_cuda.runtime", "omnigraph.plugin.omni"):
    try:
        importlib.import_module(module)
        print("import", module, "ok")
    except Exception as error:
        print("import", module, "FAILED:", type(error).__name__, error)
from omnigraph.pipelines.registry import get_pipeline
print("pipeline", get_pipeline("laya").model_type)
EOF

# 3. op library and checkpoint, side by side
CHECKPOINT=$WORK/laya-$SIZE
( step ops-build python3 -m omnigraph.plugin.cli --debug ops build --arch 90a --out "$WORK/ops" ) &
OPS_PID=$!
step synth python3 -m omnigraph.plugin.cli --debug bundle synth laya --size "$SIZE" --seed 0 --out "$CHECKPOINT"
wait $OPS_PID

# 4. bundles, side by side
BUNDLE_PIDS=()
for name in $BUNDLES; do
  case $name in
    bf16) flags=(--precision bf16) ;;
    fast) flags=(--precision bf16 --fast) ;;
    fast16) flags=(--precision fp16 --fast) ;;
    fp32) flags=(--precision fp32) ;;
    *) log "unknown bundle $name in BUNDLES (bf16, fast, fast16, fp32)"; continue ;;
  esac
  ( step "bundle-$name" timeout 300 python3 -m omnigraph.plugin.cli --debug bundle build laya \
      --checkpoint "$CHECKPOINT" --out "$WORK/bundle-$name" "${flags[@]}" ) &
  BUNDLE_PIDS+=($!)
done
wait "${BUNDLE_PIDS[@]}"
du -sh "$CHECKPOINT" "$WORK"/bundle-* >> "$LOG" 2>&1

# 5. the benchmark; stopped at HARD_LIMIT_S so that the report below still prints inside the run
LEFT=$(( BUDGET_S - $(elapsed) ))
STOP=$(( HARD_LIMIT_S - $(elapsed) ))
(( STOP < 1 )) && STOP=1  # `timeout 0` would mean no limit
log "== laya_gpu.py with --time-budget $LEFT, stopped after $STOP s"
timeout -k 5 "$STOP" python3 benchmarks/laya_gpu.py --device "$DEVICE" --size "$SIZE" \
  --checkpoint "$CHECKPOINT" --requests "$REQUESTS" \
  --bundle bf16="$WORK/bundle-bf16" --bundle fast="$WORK/bundle-fast" --bundle fast16="$WORK/bundle-fast16" \
  --bundle fp32="$WORK/bundle-fp32" \
  ${CASES:+--cases $CASES} --time-budget "$LEFT" --json "$JSON" >> "$LOG" 2>&1
RC=$?
log "== laya_gpu.py: exit $RC"

echo
if [[ -f $JSON ]]; then
  python3 benchmarks/laya_gpu.py --report "$JSON"
else
  echo "no $JSON: the last 40 lines of the log"
  tail -n 40 "$LOG"
fi
