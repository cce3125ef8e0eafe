# Shared by benchmarks/gpu/h200_run.sh and throughput_run.sh: the environment of a run's Python
# processes, its log, and the CUDA loader-path fallback. Source it after setting START, REPO, SITE,
# OUT, WORK and LOG.

mkdir -p "$OUT" "$WORK"
: > "$LOG"

export PYTHONUNBUFFERED=1
export OMNIGRAPH_CACHE=$WORK/cache
export PYTHONPATH=$HOME/.ortgpu:$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}
[[ -d $REPO/.gpu/ort-include ]] && export ORT_INCLUDE_DIR=$REPO/.gpu/ort-include

elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[$(elapsed) s] $*" | tee -a "$LOG"; }

# step NAME COMMAND...: run it, its output into the log, and record whether it passed.
step() {
  local name=$1; shift
  local began=$(date +%s)
  log "== $name: $*"
  "$@" >> "$LOG" 2>&1
  local rc=$?
  log "== $name: exit $rc after $(( $(date +%s) - began )) s"
  return $rc
}

# The graph workers load CUDA without torch (onnxruntime.preload_dlls); where that is not enough,
# this puts the machine's nvidia-* libraries (CUDA 13, cuDNN 9) on every process's loader path.
nvidia_loader_path() {
  local libs
  libs=$(python3 -c 'import glob, os, nvidia
print(":".join(sorted({os.path.dirname(p) for root in nvidia.__path__
                       for p in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)})))')
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
