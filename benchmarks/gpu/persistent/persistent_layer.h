// The persistent weight-streaming layer kernel (persistent_layer.cu): one launch runs the
// projection chain of 1..kMaxLayers ModernBERT layers (d=1024, F=2624) for M <= 512 rows, as four
// dependent phases per layer (Wo -> Wi -> Wo_mlp -> next Wqkv).
//
// Weights are pre-packed (persistent_layer.py `pack_weight`, `pack_wi`), "n8-major":
// W [N, K] -> [N/8, K/32, 8, 4, 8] from W.reshape(N/8, 8, K/32, 4, 8).transpose(0, 2, 1, 3, 4),
// so the 8 rows of one n8 group over all of K are one contiguous run and a task's weights (a range
// of n8 groups, full K) are one contiguous run, whatever the tiling. Wi's rows are interleaved
// first, 8 gate rows then the matching 8 up rows (`pack_wi`), so GeGLU is the GEMM's epilogue.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace omnigraph {
namespace persistent {

constexpr int kMaxLayers = 28;
constexpr int kPhases = 4;    // Wo, Wi, Wo_mlp, Wqkv
constexpr int kMaxTiles = 512;  // column tiles per phase

struct LayerWeights {
  const __nv_bfloat16* wo;      // packed [1024, 1024]
  const __nv_bfloat16* wi;      // packed, interleaved [5248, 1024]
  const __nv_bfloat16* wo_mlp;  // packed [1024, 2624]
  const __nv_bfloat16* wqkv;    // packed [3072, 1024] (the next layer's)
  const float* mlp_norm;        // [1024]
  const float* attn_norm;       // [1024] (the next layer's)
};

// How each phase is cut into tasks: `tiles` column tiles (balanced ranges of n8 groups; Wi's unit
// is a gate/up pair of groups), each split into `splits` K ranges. splits > 1 writes FP32 partials
// and the last task of a tile to arrive (a ticket) sums them and runs the epilogue; splits == 1
// runs the epilogue straight from the accumulators. Phases 0 and 2 (LayerNorm epilogues) need
// tiles * splits <= grid.
struct Plan {
  int tiles[kPhases];
  int splits[kPhases];
};

struct Args {
  int m;
  int layers;
  float epsilon;
  const __nv_bfloat16* ctx;  // [m, 1024] attention context of layer 0
  const float* h_in;         // [m, 1024] residual stream before layer 0's Wo
  float* h_out;              // [m, 1024] residual stream after the last layer's MLP
  __nv_bfloat16* qkv_out;    // [m, 3072] the next layer's qkv
  uint64_t* trace;  // nullable: [0] kernel start, [1 + layer * 4 + phase] when that phase completed (ns),
                    // then per (layer * 4 + phase, CTA) a record of 11: flags (1 recorded, 2 finisher) and
                    // the 10 moments of persistent_layer.cu's TraceMoment; 1 + 4 * 28 * (1 + grid * 11) in all
  int debug_flags;  // 0; timing experiments: 1 = no A loads, 2 = no mma (wrong results)
  LayerWeights weights[kMaxLayers];
};

void DefaultPlan(int m, Plan* plan);
size_t WorkspaceBytes(int m, const Plan& plan);
// Zeroes the counters, tickets and row statistics; once per workspace (the kernel leaves them zero).
int InitWorkspace(void* workspace, int m, void* stream);
// Enqueues the kernel on `stream`; returns the cudaError_t as int. Allocates nothing, never syncs.
int Launch(const Args& args, const Plan& plan, void* workspace, void* stream, int grid_override = 0);

}  // namespace persistent
}  // namespace omnigraph
