// The persistent weight-streaming layer kernel (persistent_layer.cu): one launch runs the
// projection chain of 1..kMaxLayers ModernBERT layers (d=1024, F=2624) for M <= 512 rows.
// Weights are pre-packed (omnigraph/workers/ops/persistent.py `pack_weight`):
// W [N, K] -> [N/64, K/32, 8, 8, 4, 8] from W.reshape(N/64, 8, 8, K/32, 4, 8).transpose(0,3,1,2,4,5).
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace omnigraph {
namespace persistent {

constexpr int kMaxLayers = 28;

struct LayerWeights {
  const __nv_bfloat16* wo;      // packed [1024, 1024]
  const __nv_bfloat16* wi;      // packed [5248, 1024]
  const __nv_bfloat16* wo_mlp;  // packed [1024, 2624]
  const __nv_bfloat16* wqkv;    // packed [3072, 1024] (the next layer's)
  const float* mlp_norm;        // [1024]
  const float* attn_norm;       // [1024] (the next layer's)
};

struct Args {
  int m;
  int layers;
  int kc;  // K chunk per task (multiple of 32, <= 512) for every GEMM phase; 0 = chosen per phase
  float epsilon;
  const __nv_bfloat16* ctx;  // [m, 1024] attention context of layer 0
  const float* h_in;         // [m, 1024] residual stream before layer 0's Wo
  float* h_out;              // [m, 1024] residual stream after the last layer's MLP
  __nv_bfloat16* qkv_out;    // [m, 3072] the next layer's qkv
  uint64_t* trace;  // nullable: [0] kernel start, [1 + layer * 8 + phase] when that phase completed (ns),
                    // then 32 records of 6 (CTA 0's tasks of layer 5: phase and 5 moments), 1 + 8 * 28 + 192 in all
  int debug_flags;  // 0; timing experiments: 1 = no A loads, 2 = no mma (wrong results)
  LayerWeights weights[kMaxLayers];
};

size_t WorkspaceBytes(int m, int kc);
// Zeroes the dependency counters; once per workspace (the kernel leaves them zero when it ends).
int InitWorkspace(void* workspace, void* stream);
// Enqueues the kernel on `stream`; returns the cudaError_t as int. Allocates nothing, never syncs.
int Launch(const Args& args, void* workspace, void* stream, int grid_override = 0, int slots_override = 0);

}  // namespace persistent
}  // namespace omnigraph
