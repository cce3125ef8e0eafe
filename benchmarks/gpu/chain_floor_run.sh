#!/usr/bin/env bash
# Issue 19 on the GPU machine: build benchmarks/gpu/chain_floor.cu and time the floor of a
# one-kernel encoder (140 dependent steps, no arithmetic) at M = 64, 176 and 512; rows in
# $OUT/chain-floor.json, the table in $OUT/chain-floor.txt.
#   bash benchmarks/gpu/chain_floor_run.sh [--rows 64,176,512] [--launches 20]
set -u
OUT=${OUT:-/tmp/chain-floor-out}
mkdir -p "$OUT" build
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
/usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
  benchmarks/gpu/chain_floor.cu -o build/chain_floor 2> "$OUT/ptxas-chain-floor.txt" \
  || { cat "$OUT/ptxas-chain-floor.txt"; exit 1; }
timeout 180 build/chain_floor --json "$OUT/chain-floor.json" "$@" | tee "$OUT/chain-floor.txt"
