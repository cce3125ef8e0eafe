// The omnigraph op kernels as plain functions, free of ONNX Runtime types, so the same semantics
// are implemented once for the CPU (FP32, kernels_cpu.cc) and once for CUDA (BF16/FP16,
// kernels_cuda.cu). The ORT glue (custom_ops.cc) validates shapes and attributes before calling in.
#pragma once

#include <cstdint>

namespace omnigraph {

// Bumped whenever an op's inputs, outputs, attributes or semantics change.
constexpr int kAbiVersion = 1;

// ModernBertAttention: qkv [B, L, 3, H, D] (the Wqkv projection's output, viewed), key mask [B, L]
// (nonzero = a real token), -> context [B, L, H * D]. Rotary embedding (NeoX rotate_half) at
// positions 0..L-1 with inv_freq[k] = theta^(-2k/D); query i attends key j when key j is real and
// (window == 0 or |i - j| <= window); softmax and accumulation in FP32; a query with no key to
// attend gets zeros.
struct AttentionShape {
  int64_t batch;
  int64_t length;
  int64_t num_heads;
  int64_t head_dim;
  int64_t window;
  float rope_theta;
};

// GeGLU: x [N, 2F] -> gelu_erf(x[:, :F]) * x[:, F:] [N, F].
// AddLayerNorm: residual [N, d] FP32 + x [N, d] -> new residual [N, d] FP32 and
// LayerNorm(new residual) * weight (no bias, biased variance, eps) [N, d].

void AttentionCpu(const float* qkv, const int64_t* key_mask, float* out, const AttentionShape& shape);
void GegluCpu(const float* x, float* out, int64_t rows, int64_t features);
void AddLayerNormCpu(const float* residual, const float* x, const float* weight, float* residual_out, float* normed,
                     int64_t rows, int64_t dim, float epsilon);

#ifdef OMNIGRAPH_OPS_WITH_CUDA
enum class DeviceFloat { kBFloat16, kFloat16 };

// Launchers: enqueue on `stream` (a cudaStream_t), allocate nothing, never synchronise.
// They return the launch error (cudaError_t as int, 0 on success).
int AttentionCuda(DeviceFloat type, const void* qkv, const int64_t* key_mask, void* out, const AttentionShape& shape,
                  void* stream);
int GegluCuda(DeviceFloat type, const void* x, void* out, int64_t rows, int64_t features, void* stream);
int AddLayerNormCuda(DeviceFloat type, const float* residual, const void* x, const float* weight, float* residual_out,
                     void* normed, int64_t rows, int64_t dim, float epsilon, void* stream);
const char* CudaErrorString(int error);
bool AttentionCudaSupportsHeadDim(int64_t head_dim);
#endif

}  // namespace omnigraph
