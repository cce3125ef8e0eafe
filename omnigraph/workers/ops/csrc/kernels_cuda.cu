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

__device__ __forceinline__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

__device__ __forceinline__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// ---------------------------------------------------------------------------------------------
// Attention: one block per (query tile of kQueries, head, batch row), flash-attention style
// online softmax over key tiles of kKeys, everything in FP32 shared memory. Rotary embedding is
// applied while a tile is loaded, so no rotated copy of Q or K is ever written to global memory.
constexpr int kQueries = 32;
constexpr int kKeys = 64;
constexpr int kThreads = 128;  // 8 x 16 threads, each owning a 4-row strip of the tile

template <int D>
struct AttentionSmem {
  static constexpr int kQ = kQueries * D;      // Q[r][d], rotated and scaled
  static constexpr int kKt = D * kKeys;        // K transposed: Kt[d][c], rotated
  static constexpr int kV = kKeys * D;         // V[c][d]
  static constexpr int kP = kQueries * kKeys;  // scores, then probabilities
  static constexpr int kFloats = kQ + kKt + kV + kP + 3 * kQueries + D / 2 + kKeys;
  static constexpr size_t kBytes = sizeof(float) * kFloats;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    AttentionKernel(const T* __restrict__ qkv, const int64_t* __restrict__ key_mask, T* __restrict__ out, int length,
                    int num_heads, int window, float rope_theta) {
  constexpr int kHalf = D / 2;
  constexpr int kCols = D / 16;        // output columns per thread
  constexpr int kKeyCols = kKeys / 16;  // score columns per thread
  extern __shared__ float smem[];
  float* q_s = smem;
  float* kt_s = q_s + AttentionSmem<D>::kQ;
  float* v_s = kt_s + AttentionSmem<D>::kKt;
  float* p_s = v_s + AttentionSmem<D>::kV;
  float* row_max = p_s + AttentionSmem<D>::kP;
  float* row_sum = row_max + kQueries;
  float* row_scale = row_sum + kQueries;
  float* inv_freq = row_scale + kQueries;
  float* key_ok = inv_freq + kHalf;

  const int tid = threadIdx.x;
  const int ty = tid / 16;  // rows 4*ty .. 4*ty+3
  const int tx = tid % 16;
  const int q0 = blockIdx.x * kQueries;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int model_dim = num_heads * D;
  const int64_t token_stride = 3 * static_cast<int64_t>(model_dim);
  const T* base = qkv + static_cast<int64_t>(batch) * length * token_stride + head * D;
  const float scale = rsqrtf(static_cast<float>(D));

  for (int k = tid; k < kHalf; k += kThreads) {
    inv_freq[k] = 1.0f / powf(rope_theta, static_cast<float>(2 * k) / static_cast<float>(D));
  }
  for (int r = tid; r < kQueries; r += kThreads) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
  }
  __syncthreads();
  for (int idx = tid; idx < kQueries * kHalf; idx += kThreads) {
    const int r = idx / kHalf;
    const int k = idx % kHalf;
    const int pos = q0 + r;
    float a = 0.0f, b = 0.0f;
    if (pos < length) {
      const T* row = base + pos * token_stride;
      const float x1 = ToFloat(row[k]);
      const float x2 = ToFloat(row[k + kHalf]);
      float s, c;
      sincosf(static_cast<float>(pos) * inv_freq[k], &s, &c);
      a = (x1 * c - x2 * s) * scale;
      b = (x2 * c + x1 * s) * scale;
    }
    q_s[r * D + k] = a;
    q_s[r * D + k + kHalf] = b;
  }

  float acc[4][kCols];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) acc[i][j] = 0.0f;

  // Only key tiles that can hold a visible key for this query tile.
  int first_key = 0;
  int last_key = length - 1;
  if (window > 0) {
    first_key = max(0, q0 - window);
    last_key = min(length - 1, q0 + kQueries - 1 + window);
  }
  const int64_t* mask_row = key_mask + static_cast<int64_t>(batch) * length;

  for (int k0 = (first_key / kKeys) * kKeys; k0 <= last_key; k0 += kKeys) {
    __syncthreads();  // the previous tile's readers are done
    for (int idx = tid; idx < kKeys * kHalf; idx += kThreads) {
      const int c = idx % kKeys;
      const int k = idx / kKeys;
      const int pos = k0 + c;
      float a = 0.0f, b = 0.0f;
      if (pos < length) {
        const T* row = base + pos * token_stride + model_dim;
        const float x1 = ToFloat(row[k]);
        const float x2 = ToFloat(row[k + kHalf]);
        float s, cs;
        sincosf(static_cast<float>(pos) * inv_freq[k], &s, &cs);
        a = x1 * cs - x2 * s;
        b = x2 * cs + x1 * s;
      }
      kt_s[k * kKeys + c] = a;
      kt_s[(k + kHalf) * kKeys + c] = b;
    }
    for (int idx = tid; idx < kKeys * D; idx += kThreads) {
      const int c = idx / D;
      const int d = idx % D;
      const int pos = k0 + c;
      v_s[idx] = pos < length ? ToFloat(base[pos * token_stride + 2 * model_dim + d]) : 0.0f;
    }
    for (int c = tid; c < kKeys; c += kThreads) {
      const int pos = k0 + c;
      key_ok[c] = (pos < length && mask_row[pos] != 0) ? 1.0f : 0.0f;
    }
    __syncthreads();

    // Scores: a 4 x kKeyCols strip per thread.
    float s[4][kKeyCols];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < kKeyCols; ++j) s[i][j] = 0.0f;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      float qv[4], kv[kKeyCols];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = q_s[(4 * ty + i) * D + d];
#pragma unroll
      for (int j = 0; j < kKeyCols; ++j) kv[j] = kt_s[d * kKeys + tx * kKeyCols + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < kKeyCols; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int qpos = q0 + 4 * ty + i;
#pragma unroll
      for (int j = 0; j < kKeyCols; ++j) {
        const int c = tx * kKeyCols + j;
        const int kpos = k0 + c;
        const bool visible = key_ok[c] != 0.0f && (window == 0 || abs(qpos - kpos) <= window);
        p_s[(4 * ty + i) * kKeys + c] = visible ? s[i][j] : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax: each warp owns kQueries / 4 rows; each lane two columns of a row.
    const int warp = tid / 32;
    const int lane = tid % 32;
    for (int r = warp * (kQueries / 4); r < (warp + 1) * (kQueries / 4); ++r) {
      const float s0 = p_s[r * kKeys + lane];
      const float s1 = p_s[r * kKeys + lane + 32];
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, WarpMax(fmaxf(s0, s1)));
      float p0 = 0.0f, p1 = 0.0f, rescale = 1.0f;
      if (new_max != -INFINITY) {
        p0 = s0 == -INFINITY ? 0.0f : expf(s0 - new_max);
        p1 = s1 == -INFINITY ? 0.0f : expf(s1 - new_max);
        rescale = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
      }
      const float tile_sum = WarpSum(p0 + p1);
      p_s[r * kKeys + lane] = p0;
      p_s[r * kKeys + lane + 32] = p1;
      __syncwarp();
      if (lane == 0) {
        row_max[r] = new_max;
        row_sum[r] = row_sum[r] * rescale + tile_sum;
        row_scale[r] = rescale;
      }
    }
    __syncthreads();

    // Accumulate P V into the 4 x kCols strip.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float rescale = row_scale[4 * ty + i];
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[i][j] *= rescale;
    }
#pragma unroll 4
    for (int c = 0; c < kKeys; ++c) {
      float vv[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j) vv[j] = v_s[c * D + tx * kCols + j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float p = p_s[(4 * ty + i) * kKeys + c];
#pragma unroll
        for (int j = 0; j < kCols; ++j) acc[i][j] = fmaf(p, vv[j], acc[i][j]);
      }
    }
  }
  __syncthreads();

#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = 4 * ty + i;
    const int pos = q0 + r;
    if (pos >= length) continue;
    const float total = row_sum[r];
    const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;  // no visible key: zeros
    T* o = out + (static_cast<int64_t>(batch) * length + pos) * model_dim + head * D + tx * kCols;
#pragma unroll
    for (int j = 0; j < kCols; ++j) o[j] = FromFloat<T>(acc[i][j] * inv_total);
  }
}

template <typename T, int D>
int LaunchAttention(const void* qkv, const int64_t* key_mask, void* out, const AttentionShape& shape,
                    cudaStream_t stream) {
  const size_t smem = AttentionSmem<D>::kBytes;
  cudaError_t status =
      cudaFuncSetAttribute(AttentionKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return status;
  const dim3 grid(static_cast<unsigned>((shape.length + kQueries - 1) / kQueries),
                  static_cast<unsigned>(shape.num_heads), static_cast<unsigned>(shape.batch));
  AttentionKernel<T, D><<<grid, kThreads, smem, stream>>>(
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
// GeGLU: elementwise over [rows, features].
template <typename T>
__global__ void GegluKernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t features) {
  const int64_t total = rows * features;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / features;
    const int64_t f = idx - r * features;
    const float a = ToFloat(x[r * 2 * features + f]);
    const float g = ToFloat(x[r * 2 * features + features + f]);
    out[idx] = FromFloat<T>(0.5f * a * (1.0f + erff(a * 0.70710678118654752f)) * g);
  }
}

template <typename T>
int LaunchGeglu(const void* x, void* out, int64_t rows, int64_t features, cudaStream_t stream) {
  const int64_t total = rows * features;
  if (total == 0) return cudaSuccess;
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
