// FP32 CPU kernels: the reference semantics of every op, used where no GPU is present.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace omnigraph {

namespace {

// Rotates one head vector in place (NeoX rotate_half): for k < D/2,
// x[k] <- x[k] cos - x[k + D/2] sin and x[k + D/2] <- x[k + D/2] cos + x[k] sin.
void ApplyRotary(float* x, int64_t position, int64_t head_dim, float theta) {
  const int64_t half = head_dim / 2;
  for (int64_t k = 0; k < half; ++k) {
    const float inv_freq = 1.0f / std::pow(theta, static_cast<float>(2 * k) / static_cast<float>(head_dim));
    const float angle = static_cast<float>(position) * inv_freq;
    const float c = std::cos(angle);
    const float s = std::sin(angle);
    const float x1 = x[k];
    const float x2 = x[k + half];
    x[k] = x1 * c - x2 * s;
    x[k + half] = x2 * c + x1 * s;
  }
}

}  // namespace

void AttentionCpu(const float* qkv, const int64_t* key_mask, float* out, const AttentionShape& shape) {
  const int64_t B = shape.batch, L = shape.length, H = shape.num_heads, D = shape.head_dim;
  const int64_t model_dim = H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> q(L * D), k(L * D), v(L * D), scores(L);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* mask = key_mask + b * L;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < L; ++t) {
        const float* row = qkv + (b * L + t) * 3 * model_dim + h * D;
        std::copy(row, row + D, q.data() + t * D);
        std::copy(row + model_dim, row + model_dim + D, k.data() + t * D);
        std::copy(row + 2 * model_dim, row + 2 * model_dim + D, v.data() + t * D);
        ApplyRotary(q.data() + t * D, t, D, shape.rope_theta);
        ApplyRotary(k.data() + t * D, t, D, shape.rope_theta);
      }
      for (int64_t i = 0; i < L; ++i) {
        float* o = out + (b * L + i) * model_dim + h * D;
        float max_score = -INFINITY;
        for (int64_t j = 0; j < L; ++j) {
          const bool visible = mask[j] != 0 && (shape.window == 0 || std::llabs(i - j) <= shape.window);
          if (!visible) {
            scores[j] = -INFINITY;
            continue;
          }
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += q[i * D + d] * k[j * D + d];
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        std::fill(o, o + D, 0.0f);
        if (max_score == -INFINITY) continue;  // no key to attend: zeros
        float total = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
          if (scores[j] == -INFINITY) continue;
          const float p = std::exp(scores[j] - max_score);
          total += p;
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[j * D + d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= total;
      }
    }
  }
}

void GegluCpu(const float* x, float* out, int64_t rows, int64_t features) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = x + r * 2 * features;
    const float* g = a + features;
    float* o = out + r * features;
    for (int64_t f = 0; f < features; ++f) {
      const float gelu = 0.5f * a[f] * (1.0f + std::erf(a[f] * 0.70710678118654752f));
      o[f] = gelu * g[f];
    }
  }
}

void AddLayerNormCpu(const float* residual, const float* x, const float* weight, float* residual_out, float* normed,
                     int64_t rows, int64_t dim, float epsilon) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* res = residual + r * dim;
    const float* in = x + r * dim;
    float* res_out = residual_out + r * dim;
    float* o = normed + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; ++i) {
      res_out[i] = res[i] + in[i];
      sum += res_out[i];
    }
    const float mean = static_cast<float>(sum / static_cast<double>(dim));
    double squares = 0.0;
    for (int64_t i = 0; i < dim; ++i) {
      const float centred = res_out[i] - mean;
      squares += static_cast<double>(centred) * centred;
    }
    const float inv_std = 1.0f / std::sqrt(static_cast<float>(squares / static_cast<double>(dim)) + epsilon);
    for (int64_t i = 0; i < dim; ++i) o[i] = (res_out[i] - mean) * inv_std * weight[i];
  }
}

}  // namespace omnigraph
