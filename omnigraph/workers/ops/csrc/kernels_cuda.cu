// CUDA kernels (BF16 / FP16 activations, FP32 math) with the semantics of kernels_cpu.cc.
// Every launcher enqueues on the caller's stream, allocates nothing and never synchronises, so a
// graph made of these ops can be captured as a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels.h"

namespace omnigraph {

namespace {

template <typename T>
__device__ __forceinline__ float ToFloat(T value);
template <>
__device__ __forceinline__ float ToFloat(__nv_bfloat16 value) {
  return __bfloat162float(value);
}
template <>
__device__ __forceinline__ float ToFloat(__half value) {
  return __half2float(value);
}

template <typename T>
__device__ __forceinline__ T FromFloat(float value);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat(float value) {
  return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half FromFloat(float value) {
  return __float2half_rn(value);
}

__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// ---------------------------------------------------------------------------------------------
// Attention on the tensor cores: FlashAttention-2 with mma.sync m16n8k16 (BF16/FP16 operands, FP32
// accumulators), portable to every GPU from sm_80 on. One block per (query tile of kQueryRows, head,
// batch row) walks the key tiles of kKeyRows that can hold a visible key (the sliding window skips
// the rest). Its warps form kQueryGroups x kKeySplit: a warp owns 16 query rows and one part of
// every key tile, keeps its Q fragments and its 16 x D partial output in registers with its own
// FP32 online softmax, and the parts of a group are merged once at the end. Splitting the keys
// doubles the warps that hide each other's latencies (on the H200 at L=512: 17.3 -> 14.5 us global,
// 10.3 -> 7.5 us with window 64; benchmarks/results/ops-h200-2026-11-29-attn.md). Key tiles
// are double-buffered in shared memory: V arrives by cp.async and K through registers, rotated on
// the way, while the previous tile is computed. Rotary embedding is applied in FP32 as Q and K are
// loaded, so no rotated copy is ever written to global memory; the rotated values are rounded to T
// for the mma.
constexpr int kQueryGroups = 4;
constexpr int kKeySplit = 2;
constexpr int kAttnWarps = kQueryGroups * kKeySplit;
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kQueryRows = 16 * kQueryGroups;  // one m16 tile per group
constexpr int kKeyRows = 64;
constexpr int kPartKeys = kKeyRows / kKeySplit;  // keys of a tile one warp handles

template <int D>
struct AttentionTile {
  static constexpr int kStride = D + 8;  // elements per shared row: the 16-byte pad keeps ldmatrix conflict-free
  static constexpr int kQ = kQueryRows * kStride;
  static constexpr int kKV = kKeyRows * kStride;
  // T q[kQueryRows][kStride], k[2][kKeyRows][kStride], v[2][kKeyRows][kStride];
  // float key_bias[2][kKeyRows], inv_freq[D / 2]
  static constexpr size_t kBytes = 2 * static_cast<size_t>(kQ + 4 * kKV) + sizeof(float) * (2 * kKeyRows + D / 2);
  // After the key loop the K and V buffers hold, per query group, the softmax state of its second
  // key part for every lane: D / 2 accumulators, 2 row maxima, 2 row sums.
  static constexpr int kMergeFloats = D / 2 + 4;
  static_assert(kKeySplit == 2, "the merge combines two key parts");
  static_assert(sizeof(float) * kQueryGroups * kMergeFloats * 32 <= 2 * 4 * static_cast<size_t>(kKV),
                "merge state fits in the K and V buffers");
};

template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ __forceinline__ float2 ToFloat2(Type value) { return __bfloat1622float2(value); }
  static __device__ __forceinline__ Type FromFloat2(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair<__half> {
  using Type = __half2;
  static __device__ __forceinline__ float2 ToFloat2(Type value) { return __half22float2(value); }
  static __device__ __forceinline__ Type FromFloat2(float a, float b) { return __floats2half2_rn(a, b); }
};

template <typename T>
__device__ __forceinline__ uint32_t PackPair(float a, float b) {
  const typename Pair<T>::Type pair = Pair<T>::FromFloat2(a, b);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// c += a (16 x 16, row-major fragment) * b (16 x 8, column-major fragment), FP32 accumulators.
template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t SharedAddress(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Four 8 x 8 matrices of 16-bit elements; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row))
               : "memory");
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row))
               : "memory");
}

// 16 bytes global -> shared without passing through registers; `valid` false writes zeros.
__device__ __forceinline__ void CpAsync16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(SharedAddress(shared)), "l"(global),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// sin and cos of a rotary angle (>= 0, up to the sequence length in radians): reduced into
// [-pi, pi] with a two-part 2*pi first, where the hardware approximations are accurate to ~1e-6.
__device__ __forceinline__ void RotarySinCos(float angle, float* sine, float* cosine) {
  const float turns = rintf(angle * 0.159154943091895336f);
  float reduced = fmaf(-turns, 6.28318548202514648f, angle);  // float(2 pi)
  reduced = fmaf(-turns, -1.74845553e-7f, reduced);            // 2 pi - float(2 pi)
  __sincosf(reduced, sine, cosine);
}

// The rows of a Q or K tile that one thread rotates: task i covers 8 dimensions of both halves
// (d and d + D/2) of one row. Load() issues the global reads, Store() rotates and writes the tile,
// so that other work can run between the two.
template <typename T, int D>
struct RotaryRows {
  static constexpr int kChunks = D / 16;  // 8-element chunks in half a row
  static constexpr int kTotal = kKeyRows * kChunks;
  static constexpr int kTasks = (kTotal + kAttnThreads - 1) / kAttnThreads;
  static_assert(kQueryRows == kKeyRows, "Q and K tiles have the same rows");
  uint4 low[kTasks];
  uint4 high[kTasks];

  __device__ __forceinline__ void Load(const T* base, int64_t token_stride, int row0, int length) {
#pragma unroll
    for (int i = 0; i < kTasks; ++i) {
      const int task = threadIdx.x + i * kAttnThreads;
      if (kTotal % kAttnThreads != 0 && task >= kTotal) break;
      const int pos = row0 + task / kChunks;
      const int dim = (task % kChunks) * 8;
      low[i] = high[i] = make_uint4(0, 0, 0, 0);
      if (pos < length) {
        const T* row = base + pos * token_stride;
        low[i] = __ldg(reinterpret_cast<const uint4*>(row + dim));
        high[i] = __ldg(reinterpret_cast<const uint4*>(row + dim + D / 2));
      }
    }
  }

  __device__ __forceinline__ void Store(T* tile, int row0, const float* inv_freq) const {
    using P = Pair<T>;
#pragma unroll
    for (int i = 0; i < kTasks; ++i) {
      const int task = threadIdx.x + i * kAttnThreads;
      if (kTotal % kAttnThreads != 0 && task >= kTotal) break;
      const int row = task / kChunks;
      const int dim = (task % kChunks) * 8;
      const float pos = static_cast<float>(row0 + row);
      const auto* x1 = reinterpret_cast<const typename P::Type*>(&low[i]);
      const auto* x2 = reinterpret_cast<const typename P::Type*>(&high[i]);
      uint4 rotated_low, rotated_high;
      auto* y1 = reinterpret_cast<typename P::Type*>(&rotated_low);
      auto* y2 = reinterpret_cast<typename P::Type*>(&rotated_high);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 a = P::ToFloat2(x1[j]);
        const float2 b = P::ToFloat2(x2[j]);
        float s0, c0, s1, c1;
        RotarySinCos(pos * inv_freq[dim + 2 * j], &s0, &c0);
        RotarySinCos(pos * inv_freq[dim + 2 * j + 1], &s1, &c1);
        y1[j] = P::FromFloat2(a.x * c0 - b.x * s0, a.y * c1 - b.y * s1);
        y2[j] = P::FromFloat2(b.x * c0 + a.x * s0, b.y * c1 + a.y * s1);
      }
      T* out = tile + row * AttentionTile<D>::kStride + dim;
      *reinterpret_cast<uint4*>(out) = rotated_low;
      *reinterpret_cast<uint4*>(out + D / 2) = rotated_high;
    }
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionKernel(const T* __restrict__ qkv, const int64_t* __restrict__ key_mask, T* __restrict__ out, int length,
                    int num_heads, int window, float rope_theta) {
  using Tile = AttentionTile<D>;
  constexpr int kStride = Tile::kStride;
  constexpr int kVectors = D / 8;  // 16-byte vectors per row
  extern __shared__ __align__(16) unsigned char attention_smem[];
  T* q_s = reinterpret_cast<T*>(attention_smem);
  T* k_s = q_s + Tile::kQ;
  T* v_s = k_s + 2 * Tile::kKV;
  float* key_bias = reinterpret_cast<float*>(v_s + 2 * Tile::kKV);  // 0 for a real key, -inf for padding
  float* inv_freq = key_bias + 2 * kKeyRows;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp % kQueryGroups;
  const int part = warp / kQueryGroups;
  const int q0 = blockIdx.x * kQueryRows;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int model_dim = num_heads * D;
  const int64_t token_stride = 3 * static_cast<int64_t>(model_dim);
  const T* q_base = qkv + static_cast<int64_t>(batch) * length * token_stride + head * D;
  const T* k_base = q_base + model_dim;
  const T* v_base = q_base + 2 * model_dim;
  const int64_t* mask_row = key_mask + static_cast<int64_t>(batch) * length;

  // Only key tiles that can hold a visible key for this query tile.
  int first_key = 0;
  int last_key = length - 1;
  if (window > 0) {
    first_key = max(0, q0 - window);
    last_key = min(length - 1, q0 + kQueryRows - 1 + window);
  }
  const int first_tile = first_key / kKeyRows;
  const int last_tile = last_key / kKeyRows;

  RotaryRows<T, D> next_k;
  bool next_key_real = false;
  // Starts loading key tile `tile` into buffer `stage`: V by cp.async, K and the mask into registers.
  auto issue_tile = [&](int tile, int stage) {
    const int k0 = tile * kKeyRows;
    next_k.Load(k_base, token_stride, k0, length);
    for (int idx = threadIdx.x; idx < kKeyRows * kVectors; idx += kAttnThreads) {
      const int pos = k0 + idx / kVectors;
      const int dim = (idx % kVectors) * 8;
      const bool valid = pos < length;
      CpAsync16(v_s + stage * Tile::kKV + (idx / kVectors) * kStride + dim,
                v_base + (valid ? pos : 0) * token_stride + dim, valid);
    }
    CpAsyncCommit();
    if (threadIdx.x < kKeyRows) {
      const int pos = k0 + threadIdx.x;
      next_key_real = pos < length && mask_row[pos] != 0;
    }
  };
  // Completes it: rotates K into shared memory, publishes the mask, waits for V.
  auto finish_tile = [&](int tile, int stage) {
    next_k.Store(k_s + stage * Tile::kKV, tile * kKeyRows, inv_freq);
    if (threadIdx.x < kKeyRows) key_bias[stage * kKeyRows + threadIdx.x] = next_key_real ? 0.0f : -INFINITY;
    CpAsyncWaitAll();
  };

  issue_tile(first_tile, 0);
  {
    RotaryRows<T, D> q_rows;
    q_rows.Load(q_base, token_stride, q0, length);
    for (int k = threadIdx.x; k < D / 2; k += kAttnThreads) {  // while the loads are in flight
      inv_freq[k] = 1.0f / powf(rope_theta, static_cast<float>(2 * k) / static_cast<float>(D));
    }
    __syncthreads();  // inv_freq
    q_rows.Store(q_s, q0, inv_freq);
  }
  finish_tile(first_tile, 0);
  __syncthreads();

  // The group's 16 query rows as A fragments, one per 16 dimensions.
  uint32_t q_frag[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    LdMatrixX4(q_frag[kk], q_s + (group * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
  }

  // Thread (lane) holds rows lane/4 and lane/4 + 8 of the group's tile, columns 2 * (lane % 4) + {0, 1}
  // of every 8-wide accumulator block.
  const int group_q0 = q0 + group * 16;
  const int query[2] = {group_q0 + lane / 4, group_q0 + lane / 4 + 8};
  const float scale_log2 = rsqrtf(static_cast<float>(D)) * 1.44269504088896341f;  // softmax in base 2
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's columns only; the quad is summed at the end
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int tile = first_tile, stage = 0; tile <= last_tile; ++tile, stage ^= 1) {
    const bool has_next = tile < last_tile;
    if (has_next) issue_tile(tile + 1, stage ^ 1);
    // This warp's keys [key0, key0 + kPartKeys) against its rows [group_q0, group_q0 + 15]: skipped
    // when the window hides them all, checked key by key only when the window cuts through them.
    const int key0 = tile * kKeyRows + part * kPartKeys;
    const int nearest = max(group_q0 - (key0 + kPartKeys - 1), key0 - (group_q0 + 15));
    const int farthest = max(group_q0 + 15 - key0, key0 + kPartKeys - 1 - group_q0);
    const bool sees_keys = group_q0 < length && (window == 0 || nearest <= window);
    const bool window_cuts = window > 0 && farthest > window;
    if (sees_keys) {
      const T* k_part = k_s + stage * Tile::kKV + part * kPartKeys * kStride;
      const T* v_part = v_s + stage * Tile::kKV + part * kPartKeys * kStride;
      const float* bias = key_bias + stage * kKeyRows + part * kPartKeys;

      // Scores S = Q K^T: 16 x kPartKeys, as kPartKeys / 8 accumulator blocks.
      float s[kPartKeys / 8][4];
#pragma unroll
      for (int n = 0; n < kPartKeys / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int nn = 0; nn < kPartKeys / 16; ++nn) {
          uint32_t b[4];
          LdMatrixX4(b, k_part + (nn * 16 + (lane / 16) * 8 + lane % 8) * kStride + kk * 16 + ((lane / 8) % 2) * 8);
          Mma<T>(s[2 * nn], q_frag[kk], b[0], b[1]);
          Mma<T>(s[2 * nn + 1], q_frag[kk], b[2], b[3]);
        }
      }

      // Mask, then the online softmax update (base 2, scale folded in).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kPartKeys / 8; ++n) {
        const float2 key_bias_pair = *reinterpret_cast<const float2*>(bias + n * 8 + 2 * (lane % 4));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float score = fmaf(s[n][e], scale_log2, e % 2 ? key_bias_pair.y : key_bias_pair.x);
          if (window_cuts && abs(query[e / 2] - (key0 + n * 8 + 2 * (lane % 4) + e % 2)) > window) {
            score = -INFINITY;
          }
          s[n][e] = score;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], score);
        }
      }
      float offset[2], rescale[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_max = fmaxf(row_max[r], tile_max[r]);
        offset[r] = new_max == -INFINITY ? 0.0f : new_max;  // nothing visible yet: every p is 0
        rescale[r] = exp2f(row_max[r] - offset[r]);
        row_max[r] = new_max;
        row_sum[r] *= rescale[r];
      }
#pragma unroll
      for (int n = 0; n < kPartKeys / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(s[n][e] - offset[e / 2]);
          row_sum[e / 2] += s[n][e];
        }
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[j][0] *= rescale[0];
        acc[j][1] *= rescale[0];
        acc[j][2] *= rescale[1];
        acc[j][3] *= rescale[1];
      }

      // acc += P V: the score accumulators are already P's A fragments, 16 keys at a time.
#pragma unroll
      for (int kk = 0; kk < kPartKeys / 16; ++kk) {
        const uint32_t p[4] = {PackPair<T>(s[2 * kk][0], s[2 * kk][1]), PackPair<T>(s[2 * kk][2], s[2 * kk][3]),
                               PackPair<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               PackPair<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {
          uint32_t b[4];
          LdMatrixX4Trans(b, v_part + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride + nn * 16 + (lane / 16) * 8);
          Mma<T>(acc[2 * nn], p, b[0], b[1]);
          Mma<T>(acc[2 * nn + 1], p, b[2], b[3]);
        }
      }
    }
    if (has_next) finish_tile(tile + 1, stage ^ 1);
    __syncthreads();  // the next tile is in place and nobody reads this one any more
  }

  // Merge the two key parts of each group: the second hands its state over through the (now free)
  // K and V buffers, lane for lane, since both hold the same fragment layout.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  float* merge = reinterpret_cast<float*>(k_s) + group * Tile::kMergeFloats * 32 + lane;
  if (part == 1) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) merge[(4 * j + e) * 32] = acc[j][e];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      merge[(D / 2 + r) * 32] = row_max[r];
      merge[(D / 2 + 2 + r) * 32] = row_sum[r];
    }
  }
  __syncthreads();
  if (part == 1) return;

  float own_scale[2], other_scale[2], inv_total[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float other_max = merge[(D / 2 + r) * 32];
    const float other_sum = merge[(D / 2 + 2 + r) * 32];
    const float new_max = fmaxf(row_max[r], other_max);
    const float offset = new_max == -INFINITY ? 0.0f : new_max;
    own_scale[r] = exp2f(row_max[r] - offset);
    other_scale[r] = exp2f(other_max - offset);
    const float total = row_sum[r] * own_scale[r] + other_sum * other_scale[r];
    inv_total[r] = total > 0.0f ? 1.0f / total : 0.0f;  // no visible key: zeros
  }

  // Normalise, stage the group's 16 x D rows in its own (no longer read) Q rows, store 16 bytes a lane.
  T* o_s = q_s + group * 16 * kStride;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      o[e] = (acc[j][e] * own_scale[e / 2] + merge[(4 * j + e) * 32] * other_scale[e / 2]) * inv_total[e / 2];
    }
    T* row = o_s + (lane / 4) * kStride + j * 8 + 2 * (lane % 4);
    *reinterpret_cast<typename Pair<T>::Type*>(row) = Pair<T>::FromFloat2(o[0], o[1]);
    *reinterpret_cast<typename Pair<T>::Type*>(row + 8 * kStride) = Pair<T>::FromFloat2(o[2], o[3]);
  }
  __syncwarp();
  for (int idx = lane; idx < 16 * kVectors; idx += 32) {
    const int row = idx / kVectors;
    const int dim = (idx % kVectors) * 8;
    const int pos = group_q0 + row;
    if (pos < length) {
      *reinterpret_cast<uint4*>(out + (static_cast<int64_t>(batch) * length + pos) * model_dim + head * D + dim) =
          *reinterpret_cast<const uint4*>(o_s + row * kStride + dim);
    }
  }
}

template <typename T, int D>
int LaunchAttention(const void* qkv, const int64_t* key_mask, void* out, const AttentionShape& shape,
                    cudaStream_t stream) {
  const size_t smem = AttentionTile<D>::kBytes;
  cudaError_t status =
      cudaFuncSetAttribute(AttentionKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>((shape.length + kQueryRows - 1) / kQueryRows),
                  static_cast<unsigned>(shape.num_heads), static_cast<unsigned>(shape.batch));
  AttentionKernel<T, D><<<grid, kAttnThreads, smem, stream>>>(
      static_cast<const T*>(qkv), key_mask, static_cast<T*>(out), static_cast<int>(shape.length),
      static_cast<int>(shape.num_heads), static_cast<int>(shape.window), shape.rope_theta);
  return cudaGetLastError();
}

template <typename T>
int DispatchAttention(const void* qkv, const int64_t* key_mask, void* out, const AttentionShape& shape,
                      cudaStream_t stream) {
  switch (shape.head_dim) {
    case 32:
      return LaunchAttention<T, 32>(qkv, key_mask, out, shape, stream);
    case 64:
      return LaunchAttention<T, 64>(qkv, key_mask, out, shape, stream);
    case 128:
      return LaunchAttention<T, 128>(qkv, key_mask, out, shape, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------
// GeGLU: elementwise over [rows, features]. The same per-element arithmetic in two layouts: eight
// features per thread through 16-byte loads and stores where every row starts 16-byte aligned (the
// usual case: features % 8 == 0), one feature per thread otherwise.
__device__ __forceinline__ float GeluTimes(float a, float g) {
  return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f)) * g;
}

template <typename T>
__global__ void GegluKernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t features) {
  const int64_t total = rows * features;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / features;
    const int64_t f = idx - r * features;
    out[idx] = FromFloat<T>(GeluTimes(ToFloat(x[r * 2 * features + f]), ToFloat(x[r * 2 * features + features + f])));
  }
}

constexpr int kGegluVector = 8;  // 16 bytes of a 2-byte type

template <typename T>
__global__ void GegluVectorKernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t features) {
  const int64_t vectors = features / kGegluVector;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const uint4* gate_in = reinterpret_cast<const uint4*>(x + r * 2 * features);
    const uint4* up_in = reinterpret_cast<const uint4*>(x + r * 2 * features + features);
    uint4* row_out = reinterpret_cast<uint4*>(out + r * features);
    for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
         v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const uint4 a_bits = gate_in[v], g_bits = up_in[v];
      uint4 o_bits;
      const T* a = reinterpret_cast<const T*>(&a_bits);
      const T* g = reinterpret_cast<const T*>(&g_bits);
      T* o = reinterpret_cast<T*>(&o_bits);
#pragma unroll
      for (int i = 0; i < kGegluVector; ++i) o[i] = FromFloat<T>(GeluTimes(ToFloat(a[i]), ToFloat(g[i])));
      row_out[v] = o_bits;
    }
  }
}

template <typename T>
int LaunchGeglu(const void* x, void* out, int64_t rows, int64_t features, cudaStream_t stream) {
  const int64_t total = rows * features;
  if (total == 0) return cudaSuccess;
  const bool aligned = features % kGegluVector == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (aligned) {
    constexpr int kBlock = 128;
    const int64_t vectors = features / kGegluVector;
    const dim3 grid(static_cast<unsigned>((vectors + kBlock - 1) / kBlock),
                    static_cast<unsigned>(rows < 65535 ? rows : 65535));
    GegluVectorKernel<T><<<grid, kBlock, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(out), rows, features);
    return cudaGetLastError();
  }
  constexpr int kBlock = 256;
  const int64_t blocks = (total + kBlock - 1) / kBlock;
  GegluKernel<T><<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kBlock, 0, stream>>>(
      static_cast<const T*>(x), static_cast<T*>(out), rows, features);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// AddLayerNorm: one block per row; the FP32 row lives in shared memory between the two passes.
constexpr int kNormThreads = 256;

__device__ float BlockSum(float value, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = WarpSum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kNormThreads / 32; ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next call
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    AddLayerNormKernel(const float* __restrict__ residual, const T* __restrict__ x, const float* __restrict__ weight,
                       float* __restrict__ residual_out, T* __restrict__ normed, int64_t dim, float epsilon) {
  extern __shared__ float row[];
  __shared__ float scratch[kNormThreads / 32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    const float value = residual[offset + i] + ToFloat(x[offset + i]);
    row[i] = value;
    residual_out[offset + i] = value;
    sum += value;
  }
  const float mean = BlockSum(sum, scratch) / static_cast<float>(dim);
  float squares = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    const float centred = row[i] - mean;
    squares += centred * centred;
  }
  const float inv_std = rsqrtf(BlockSum(squares, scratch) / static_cast<float>(dim) + epsilon);
  for (int64_t i = threadIdx.x; i < dim; i += kNormThreads) {
    normed[offset + i] = FromFloat<T>((row[i] - mean) * inv_std * weight[i]);
  }
}

template <typename T>
int LaunchAddLayerNorm(const float* residual, const void* x, const float* weight, float* residual_out, void* normed,
                       int64_t rows, int64_t dim, float epsilon, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const size_t smem = sizeof(float) * static_cast<size_t>(dim);
  cudaError_t status = cudaFuncSetAttribute(AddLayerNormKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  AddLayerNormKernel<T><<<static_cast<unsigned>(rows), kNormThreads, smem, stream>>>(
      residual, static_cast<const T*>(x), weight, residual_out, static_cast<T*>(normed), dim, epsilon);
  return cudaGetLastError();
}

}  // namespace

bool AttentionCudaSupportsHeadDim(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

int AttentionCuda(DeviceFloat type, const void* qkv, const int64_t* key_mask, void* out, const AttentionShape& shape,
                  void* stream) {
  if (shape.batch == 0 || shape.length == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  return type == DeviceFloat::kBFloat16 ? DispatchAttention<__nv_bfloat16>(qkv, key_mask, out, shape, s)
                                        : DispatchAttention<__half>(qkv, key_mask, out, shape, s);
}

int GegluCuda(DeviceFloat type, const void* x, void* out, int64_t rows, int64_t features, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return type == DeviceFloat::kBFloat16 ? LaunchGeglu<__nv_bfloat16>(x, out, rows, features, s)
                                        : LaunchGeglu<__half>(x, out, rows, features, s);
}

int AddLayerNormCuda(DeviceFloat type, const float* residual, const void* x, const float* weight, float* residual_out,
                     void* normed, int64_t rows, int64_t dim, float epsilon, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  return type == DeviceFloat::kBFloat16
             ? LaunchAddLayerNorm<__nv_bfloat16>(residual, x, weight, residual_out, normed, rows, dim, epsilon, s)
             : LaunchAddLayerNorm<__half>(residual, x, weight, residual_out, normed, rows, dim, epsilon, s);
}

const char* CudaErrorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace omnigraph
