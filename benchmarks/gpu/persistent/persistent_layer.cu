// A persistent, weight-streaming kernel for the projection chain of ModernBERT layers (issue 19).
// One launch, grid = number of SMs, one CTA per SM, runs four dependent phases per layer:
//
//   phase 0  Wo      v = ctx @ Wo^T;      h1  = h + v (FP32);   xb = bf16(LN(h1) * mlp_norm)
//   phase 1  Wi      u = xb @ Wi^T;       gb  = bf16(gelu_erf(u_gate) * u_up)      (epilogue)
//   phase 2  Wo_mlp  v = gb @ Wo_mlp^T;   out = h1 + v (FP32);  yb = bf16(LN(out) * attn_norm_next)
//   phase 3  Wqkv    qkv = bf16(yb @ Wqkv_next^T)
//
// With layers == 1 this is one layer's tail after attention. With layers > 1 (benchmark only) the
// attention between layers is replaced by a stand-in: layer l+1's ctx is layer l's qkv[:, :1024].
//
// Every phase is a GEMM whose epilogue does the row work, so a layer is 4 dependency hops:
// - A task is (column tile, K range). With one K range per tile (full K) the epilogue runs from
//   the accumulators; with several, each task writes FP32 partials and takes a ticket, and the last
//   task of the tile to arrive sums them (fixed order: deterministic) and runs the epilogue.
// - GeGLU: Wi's packed rows interleave 8 gate rows with their 8 up rows, so a tile holds matching
//   gate and up columns in the same lanes.
// - LayerNorm: the tile epilogues of phases 0 and 2 add their rows' sums and sums of squares of the
//   residual output into row statistics (FP64 atomics), then meet at a counter (every tile of the
//   phase on its own CTA: the host checks tiles * splits <= grid), then each normalises its own
//   columns. The next phase reads BF16 activations as before.
// - Phases depend through one counter per (layer, phase) in global memory (release/acquire).
//
// Thread 0 streams each task's weights (n8 groups x K range, pre-packed contiguous) into a byte ring
// in shared memory with cp.async.bulk completing on mbarriers, as far ahead as the ring holds
// (weights never depend on activations), topping it up after each task's signal (the task's GEMM
// freed its region; issuing costs ~1 us, kept off the ticket and signal path). There
// is no separate producer warp: 9 warps would cap registers at 168 (3 warps on one SM quarter), 8 get
// 255. The 8 warps compute with mma.sync m16n8k16 (BF16 in, FP32 accumulate), warp = (16-row group,
// K parity), A fragments loaded straight from L2 as 16-byte loads (a K permutation that the packing
// repeats), two rounds of 4 k32 blocks in flight. The last CTA to finish resets the counters, so the
// kernel can be replayed in a CUDA graph.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../hopper_ptx.cuh"
#include "persistent_layer.h"

namespace omnigraph {
namespace persistent {

namespace {

constexpr int kConsumerWarps = 8;  // all warps compute; thread 0 also issues the weight copies
constexpr int kThreads = kConsumerWarps * 32;
constexpr int kMaxNt = 8;       // n8 tiles per task
constexpr int kRound = 4;       // k32 blocks per warp per round of A loads
constexpr int kInFlight = 16;   // tasks whose weights may be in the ring at once
constexpr int kDebugNoALoads = 1;  // timing experiments only: results are wrong with these
constexpr int kDebugNoMma = 2;
// With a trace, thread 0 of every CTA stamps each task's moments (TraceMoment, %globaltimer) into
// one record of kTraceFields per (layer, phase, CTA). A phase of at most `grid` tasks (every phase of
// the default plan) gives a CTA at most one task per phase and layer; with more, the later task's
// record is kept.
enum TraceMoment {
  kBegin,      // the task starts
  kDependency, // the previous phase is seen complete (after the CTA barrier)
  kWeights,    // the task's weights have landed
  kGemm,       // every 64-row block is multiplied and stored (epilogue or partials)
  kTicket,     // split phases: the tile's ticket is taken and every thread knows the finisher
  kEpilogue,   // the finisher has summed the partials and run the epilogue
  kMet,        // LayerNorm phases: every tile of the phase has added its statistics
  kNormalized, // LayerNorm phases: this tile's columns are normalised
  kSignalled,  // the phase counter is incremented
  kIssued,     // thread 0 has issued the weight copies that the freed ring region allows
  kMoments
};
constexpr int kTraceFields = 1 + kMoments;  // flags (1 = recorded, 2 = finisher), then the moments
constexpr int kD = 1024;
constexpr int kF = 2624;
constexpr int kQkv = 3072;
constexpr int kCountersPerLayer = 8;  // [phase] completion, [4 + phase] LayerNorm meeting (phases 0, 2)
constexpr int kReduceBytes = 4 * kMaxNt * 32 * 16;  // 4 m-warps x 8 n8-tiles x 32 lanes x float4
constexpr int kSmemFixed = 1024 + kReduceBytes;   // mbarriers, scratch, ring bookkeeping, reduce

__host__ __device__ inline int CeilDiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ inline size_t Align256(size_t v) { return (v + 255) & ~size_t(255); }

struct PhasePlan {
  int tiles, splits;
  int units, unit_groups;  // column units (n8 groups, or Wi's gate/up pairs of groups)
  int kb;                  // K / 32
  int n;                   // columns (packed order)
};

struct TaskGeo {
  int tile, split;
  int g0, nt;  // first n8 group, groups
  int b0, nb;  // first k32 block, blocks
};

__device__ __host__ inline TaskGeo Geo(const PhasePlan& pp, int local) {
  TaskGeo g;
  g.tile = local / pp.splits;
  g.split = local - g.tile * pp.splits;
  const int u0 = g.tile * pp.units / pp.tiles, u1 = (g.tile + 1) * pp.units / pp.tiles;
  g.g0 = u0 * pp.unit_groups;
  g.nt = (u1 - u0) * pp.unit_groups;
  g.b0 = g.split * pp.kb / pp.splits;
  g.nb = (g.split + 1) * pp.kb / pp.splits - g.b0;
  return g;
}

using hopper_ptx::BulkLoad;
using hopper_ptx::GlobalTimer;
using hopper_ptx::LoadAcquire;
using hopper_ptx::MbarExpectTx;
using hopper_ptx::MbarInit;
using hopper_ptx::MbarWait;
using hopper_ptx::RedRelease;

__device__ inline void ConsumerSync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory"); }

__device__ inline int AtomAddRelease(int* p, int v) {
  int old;
  asm volatile("atom.release.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ inline int AtomAddAcqRel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ inline void Mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ inline float GeluErf(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

__device__ inline uint32_t PackBf16x2(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

struct Task {
  int layer, phase, local;
};

__device__ inline Task Locate(int index, const int* prefix) {
  const int per_layer = prefix[kPhases];
  Task t;
  t.layer = index / per_layer;
  int rem = index - t.layer * per_layer;
  int p = 0;
  while (rem >= prefix[p + 1]) ++p;
  t.phase = p;
  t.local = rem - prefix[p];
  return t;
}

struct Buffers {
  int* counters;   // kMaxLayers * kCountersPerLayer, then one "finished CTAs" counter
  int* tickets;    // kMaxLayers * kPhases * kMaxTiles
  double* stats;   // [2][m_pad][2]: sum and sum of squares of each row (LN 1, LN 2)
  float* partial;  // [splits][m_pad][n] of the phase in flight
  float* h1;
  __nv_bfloat16* xb;
  __nv_bfloat16* gb;
  __nv_bfloat16* yb;
};

__host__ inline size_t ZeroedBytes(int m_pad) {
  return Align256((kMaxLayers * kCountersPerLayer + 1) * sizeof(int)) +
         Align256(size_t(kMaxLayers) * kPhases * kMaxTiles * sizeof(int)) + Align256(size_t(4) * m_pad * sizeof(double));
}

__host__ __device__ inline Buffers Carve(void* workspace, int m_pad, size_t partial_floats) {
  char* p = static_cast<char*>(workspace);
  Buffers b;
  b.counters = reinterpret_cast<int*>(p);
  p += Align256((kMaxLayers * kCountersPerLayer + 1) * sizeof(int));
  b.tickets = reinterpret_cast<int*>(p);
  p += Align256(size_t(kMaxLayers) * kPhases * kMaxTiles * sizeof(int));
  b.stats = reinterpret_cast<double*>(p);
  p += Align256(size_t(4) * m_pad * sizeof(double));
  b.partial = reinterpret_cast<float*>(p);
  p += Align256(partial_floats * sizeof(float));
  b.h1 = reinterpret_cast<float*>(p);
  p += Align256(size_t(m_pad) * kD * sizeof(float));
  b.xb = reinterpret_cast<__nv_bfloat16*>(p);
  p += Align256(size_t(m_pad) * kD * 2);
  b.gb = reinterpret_cast<__nv_bfloat16*>(p);
  p += Align256(size_t(m_pad) * kF * 2);
  b.yb = reinterpret_cast<__nv_bfloat16*>(p);
  p += Align256(size_t(m_pad) * kD * 2);
  return b;
}

struct KernelParams {
  Args args;
  Buffers buf;
  int m, m_pad;
  PhasePlan ph[kPhases];
  int prefix[kPhases + 1];
  int ring_bytes;
};

// ------------------------------------------------------------------------------------------------
// One 64-row block of a GEMM task: acc = A[mb:mb+64, K range] @ W[tile]^T for this warp's 16 rows,
// its parity of the k32 blocks. A from global (L2), W from the task's ring region, laid out
// [nt][nb][32 lanes][16 B].
// The warp's idx-th block is logical block kh + 2*idx, read at physical block (logical + rot) mod nb:
// each tile starts its K loop elsewhere, so the CTAs of a phase (which all read the same A) do not
// stream the same L2 lines at the same moment.
__device__ inline int PhysicalBlock(int kh, int idx, int rot, int nb) {
  const int b = kh + 2 * idx + rot;
  return b >= nb ? b - nb : b;
}

__device__ inline void LoadRound(uint4 (&lo)[kRound], uint4 (&hi)[kRound], const uint4* a_lo, const uint4* a_hi,
                                 int kh, int first, int mine, int rot, int nb, bool fake, int lane) {
#pragma unroll
  for (int i = 0; i < kRound; ++i) {
    const int idx = first + i;
    if (idx < mine) {
      const int bb = PhysicalBlock(kh, idx, rot, nb);
      if (fake) {
        lo[i] = hi[i] = make_uint4(lane, bb, 1, 2);
      } else {
        lo[i] = __ldcg(a_lo + bb * 4);
        hi[i] = __ldcg(a_hi + bb * 4);
      }
    }
  }
}

__device__ inline void ComputeRound(float (&acc)[kMaxNt][4], const uint4 (&lo)[kRound], const uint4 (&hi)[kRound],
                                    const uint4* w_lane, int stride, int kh, int first, int mine, int rot, int nb,
                                    int nt_count) {
#pragma unroll
  for (int i = 0; i < kRound; ++i) {
    const int idx = first + i;
    if (idx < mine) {
      const uint4* wb = w_lane + PhysicalBlock(kh, idx, rot, nb) * 32;
      if (nt_count <= 2) {  // four accumulators per n8 tile (k16 half x block parity): short mma chains
        const int set = 2 * (i & 1);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          if (nt < nt_count) {
            const uint4 w = wb[nt * stride];
            Mma(acc[nt + set], lo[i].x, hi[i].x, lo[i].y, hi[i].y, w.x, w.y);
            Mma(acc[nt + 4 + set], lo[i].z, hi[i].z, lo[i].w, hi[i].w, w.z, w.w);
          }
        }
      } else if (nt_count <= 4) {  // two accumulators per n8 tile (one per k16 half)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (nt < nt_count) {
            const uint4 w = wb[nt * stride];
            Mma(acc[nt], lo[i].x, hi[i].x, lo[i].y, hi[i].y, w.x, w.y);
            Mma(acc[nt + 4], lo[i].z, hi[i].z, lo[i].w, hi[i].w, w.z, w.w);
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kMaxNt; ++nt) {
          if (nt < nt_count) {
            const uint4 w = wb[nt * stride];
            Mma(acc[nt], lo[i].x, hi[i].x, lo[i].y, hi[i].y, w.x, w.y);
            Mma(acc[nt], lo[i].z, hi[i].z, lo[i].w, hi[i].w, w.z, w.w);
          }
        }
      }
    }
  }
}

template <bool kInstrumented>
__device__ void GemmBlock(float (&acc)[kMaxNt][4], const __nv_bfloat16* a, int lda, int nb, int rot,
                          const uint4* w_smem, int nt_count, int mb, int m, int debug) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int mw = warp & 3, kh = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int r_lo = min(mb + mw * 16 + g, m - 1), r_hi = min(mb + mw * 16 + g + 8, m - 1);
  const uint4* a_lo = reinterpret_cast<const uint4*>(a + size_t(r_lo) * lda + 8 * t);
  const uint4* a_hi = reinterpret_cast<const uint4*>(a + size_t(r_hi) * lda + 8 * t);
  const int mine = (nb - kh + 1) >> 1;  // blocks of this warp's parity
  const bool fake = kInstrumented && (debug & kDebugNoALoads);
  const bool skip = kInstrumented && (debug & kDebugNoMma);
  const uint4* w_lane = w_smem + lane;
  const int stride = nb * 32;
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  uint4 lo0[kRound], hi0[kRound], lo1[kRound], hi1[kRound];
  LoadRound(lo0, hi0, a_lo, a_hi, kh, 0, mine, rot, nb, fake, lane);
  for (int first = 0; first < mine; first += 2 * kRound) {
    LoadRound(lo1, hi1, a_lo, a_hi, kh, first + kRound, mine, rot, nb, fake, lane);
    if (!skip) ComputeRound(acc, lo0, hi0, w_lane, stride, kh, first, mine, rot, nb, nt_count);
    LoadRound(lo0, hi0, a_lo, a_hi, kh, first + 2 * kRound, mine, rot, nb, fake, lane);
    if (!skip) ComputeRound(acc, lo1, hi1, w_lane, stride, kh, first + kRound, mine, rot, nb, nt_count);
  }
  if (nt_count <= 2) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] += acc[nt + 2][e] + (acc[nt + 4][e] + acc[nt + 6][e]);
    }
  } else if (nt_count <= 4) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      acc[nt][0] += acc[nt + 4][0];
      acc[nt][1] += acc[nt + 4][1];
      acc[nt][2] += acc[nt + 4][2];
      acc[nt][3] += acc[nt + 4][3];
    }
  }
}

// The tile epilogue for one 64-row block, by the 4 warps of K parity 0 (lane (g, t) of warp mw
// holds rows mb + mw*16 + g (v[.][0..1]) and +8 (v[.][2..3]), packed columns (g0 + nt)*8 + 2t, +1).
__device__ void Epilogue(const KernelParams& p, int layer, int phase, int g0, int nt_count, int mb,
                         const float (&v)[kMaxNt][4]) {
  const int lane = threadIdx.x & 31, mw = (threadIdx.x >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  const int m = p.m;
  const int r_lo = mb + mw * 16 + g, r_hi = r_lo + 8;
  const bool ok_lo = r_lo < m, ok_hi = r_hi < m;
  if (phase == 1) {  // GeGLU: n8 tile 2j is the gate of unit g0/2 + j, 2j+1 its up
#pragma unroll
    for (int j = 0; j < kMaxNt / 2; ++j) {
      if (2 * j < nt_count) {
        const int f = (g0 / 2 + j) * 8 + 2 * t;
        if (ok_lo)
          __stcg(reinterpret_cast<uint32_t*>(p.buf.gb + size_t(r_lo) * kF + f),
                 PackBf16x2(GeluErf(v[2 * j][0]) * v[2 * j + 1][0], GeluErf(v[2 * j][1]) * v[2 * j + 1][1]));
        if (ok_hi)
          __stcg(reinterpret_cast<uint32_t*>(p.buf.gb + size_t(r_hi) * kF + f),
                 PackBf16x2(GeluErf(v[2 * j][2]) * v[2 * j + 1][2], GeluErf(v[2 * j][3]) * v[2 * j + 1][3]));
      }
    }
    return;
  }
  if (phase == 3) {
#pragma unroll
    for (int nt = 0; nt < kMaxNt; ++nt) {
      if (nt < nt_count) {
        const int c = (g0 + nt) * 8 + 2 * t;
        if (ok_lo)
          __stcg(reinterpret_cast<uint32_t*>(p.args.qkv_out + size_t(r_lo) * kQkv + c), PackBf16x2(v[nt][0], v[nt][1]));
        if (ok_hi)
          __stcg(reinterpret_cast<uint32_t*>(p.args.qkv_out + size_t(r_hi) * kQkv + c), PackBf16x2(v[nt][2], v[nt][3]));
      }
    }
    return;
  }
  // phases 0 and 2: residual add, FP32 store, row statistics
  const float* resid = phase == 0 ? (layer == 0 ? p.args.h_in : p.args.h_out) : p.buf.h1;
  float* dst = phase == 0 ? p.buf.h1 : p.args.h_out;
  float2 rl[kMaxNt], rh[kMaxNt];
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt) {
    if (nt < nt_count) {
      const int c = (g0 + nt) * 8 + 2 * t;
      rl[nt] = ok_lo ? __ldcg(reinterpret_cast<const float2*>(resid + size_t(r_lo) * kD + c)) : make_float2(0.f, 0.f);
      rh[nt] = ok_hi ? __ldcg(reinterpret_cast<const float2*>(resid + size_t(r_hi) * kD + c)) : make_float2(0.f, 0.f);
    }
  }
  float s_lo = 0.f, q_lo = 0.f, s_hi = 0.f, q_hi = 0.f;
#pragma unroll
  for (int nt = 0; nt < kMaxNt; ++nt) {
    if (nt < nt_count) {
      const int c = (g0 + nt) * 8 + 2 * t;
      const float2 yl = make_float2(v[nt][0] + rl[nt].x, v[nt][1] + rl[nt].y);
      const float2 yh = make_float2(v[nt][2] + rh[nt].x, v[nt][3] + rh[nt].y);
      if (ok_lo) __stcg(reinterpret_cast<float2*>(dst + size_t(r_lo) * kD + c), yl);
      if (ok_hi) __stcg(reinterpret_cast<float2*>(dst + size_t(r_hi) * kD + c), yh);
      s_lo += yl.x + yl.y;
      q_lo += yl.x * yl.x + yl.y * yl.y;
      s_hi += yh.x + yh.y;
      q_hi += yh.x * yh.x + yh.y * yh.y;
    }
  }
#pragma unroll
  for (int o = 1; o <= 2; o <<= 1) {
    s_lo += __shfl_xor_sync(0xffffffffu, s_lo, o);
    q_lo += __shfl_xor_sync(0xffffffffu, q_lo, o);
    s_hi += __shfl_xor_sync(0xffffffffu, s_hi, o);
    q_hi += __shfl_xor_sync(0xffffffffu, q_hi, o);
  }
  if (t == 0) {
    double* st = p.buf.stats + (phase == 2 ? 2 * p.m_pad : 0);
    if (ok_lo) {
      atomicAdd(st + 2 * r_lo, double(s_lo));
      atomicAdd(st + 2 * r_lo + 1, double(q_lo));
    }
    if (ok_hi) {
      atomicAdd(st + 2 * r_hi, double(s_hi));
      atomicAdd(st + 2 * r_hi + 1, double(q_hi));
    }
  }
}

// After every tile of phase 0 / 2 has added its statistics: normalise this tile's columns of all
// rows (256 consumer threads, 2 columns each step).
__device__ void NormalizeTile(const KernelParams& p, const LayerWeights& lw, int phase, int g0, int nt_count) {
  const float* y = phase == 0 ? p.buf.h1 : p.args.h_out;
  __nv_bfloat16* out = phase == 0 ? p.buf.xb : p.buf.yb;
  const float* w = phase == 0 ? lw.mlp_norm : lw.attn_norm;
  const double* st = p.buf.stats + (phase == 2 ? 2 * p.m_pad : 0);
  const int pairs = nt_count * 4;
  const int total = p.m * pairs;
  for (int idx = threadIdx.x; idx < total; idx += kConsumerWarps * 32) {
    const int r = idx / pairs;
    const int c = g0 * 8 + 2 * (idx - r * pairs);
    const double2 s = __ldcg(reinterpret_cast<const double2*>(st + 2 * r));
    const float2 yy = __ldcg(reinterpret_cast<const float2*>(y + size_t(r) * kD + c));
    const float2 ww = __ldg(reinterpret_cast<const float2*>(w + c));
    const double mean = s.x * (1.0 / kD);
    const double var = fmax(s.y * (1.0 / kD) - mean * mean, 0.0);
    const float rstd = rsqrtf(float(var) + p.args.epsilon);
    const float mf = float(mean);
    __stcg(reinterpret_cast<uint32_t*>(out + size_t(r) * kD + c),
           PackBf16x2((yy.x - mf) * rstd * ww.x, (yy.y - mf) * rstd * ww.y));
  }
}

// kInstrumented: the trace and the timing-experiment flags are compiled in (only then).
template <bool kInstrumented>
__global__ void __launch_bounds__(kThreads, 1) PersistentLayerKernel(const __grid_constant__ KernelParams p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  int* flag = reinterpret_cast<int*>(smem + 384);
  float4* reduce = reinterpret_cast<float4*>(smem + 1024);
  unsigned char* ring = smem + kSmemFixed;
  const int ring_bytes = p.ring_bytes;

  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kInFlight; ++s) MbarInit(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (kInstrumented && p.args.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) p.args.trace[0] = GlobalTimer();
  const int total = p.prefix[kPhases] * p.args.layers;
  const int grid = gridDim.x;

  // Weight stream (thread 0): this CTA's tasks in order, each task's weights one contiguous region
  // of the byte ring (a region that would cross the end starts at 0 instead), issued as far ahead as
  // the ring and kInFlight allow; a region frees when its task's GEMM is done (j, tail).
  int j = 0, head = 0;                                        // tasks consumed, consumer ring position
  int issue_index = blockIdx.x, issued = 0, issue_head = 0, tail = 0;  // thread 0's producer state
  auto issue = [&]() {
    while (issue_index < total && issued - j < kInFlight) {
      const Task task = Locate(issue_index, p.prefix);
      const PhasePlan& pp = p.ph[task.phase];
      const TaskGeo geo = Geo(pp, task.local);
      const int bytes = geo.nt * geo.nb * 512;
      int start = issue_head;
      if (start % ring_bytes + bytes > ring_bytes) start += ring_bytes - start % ring_bytes;
      const int end = start + bytes;
      if (end - (issued == j ? start : tail) > ring_bytes) break;  // would overwrite weights still in use
      const LayerWeights& lw = p.args.weights[task.layer];
      const __nv_bfloat16* w = task.phase == 0 ? lw.wo : task.phase == 1 ? lw.wi : task.phase == 2 ? lw.wo_mlp : lw.wqkv;
      unsigned char* dst = ring + start % ring_bytes;
      uint64_t* bar = &full[issued % kInFlight];
      MbarExpectTx(bar, uint32_t(bytes));
      if (geo.nb == pp.kb) {
        BulkLoad(dst, w + size_t(geo.g0) * pp.kb * 256, uint32_t(bytes), bar);
      } else {
        for (int i = 0; i < geo.nt; ++i)
          BulkLoad(dst + i * geo.nb * 512, w + (size_t(geo.g0 + i) * pp.kb + geo.b0) * 256, uint32_t(geo.nb * 512), bar);
      }
      issue_head = end;
      ++issued;
      issue_index += grid;
    }
  };
  if (threadIdx.x == 0) issue();

  // consumers
  int* counters = p.buf.counters;
  const int m = p.m;
  const int kh = warp >> 2;
  int ready = -1;  // highest global phase known complete (thread 0's view)
  uint64_t stamp[kMoments];  // the current task's TraceMoments (thread 0's view), with a trace
  for (int index = blockIdx.x; index < total; index += grid) {
    const Task task = Locate(index, p.prefix);
    const PhasePlan& pp = p.ph[task.phase];
    const TaskGeo geo = Geo(pp, task.local);
    const int q = task.layer * kPhases + task.phase;
    const bool traced = kInstrumented && p.args.trace != nullptr && threadIdx.x == 0;
    auto mark = [&](int moment) {
      if (traced) stamp[moment] = GlobalTimer();
    };
    for (int i = 0; i < kMoments; ++i) stamp[i] = 0;
    mark(kBegin);
    if (threadIdx.x == 0 && q > 0 && ready < q - 1) {
      const int prev = (q - 1) % kPhases, prev_layer = (q - 1) / kPhases;
      const int need = p.ph[prev].tiles;
      while (LoadAcquire(&counters[prev_layer * kCountersPerLayer + prev]) < need) {
      }
      ready = q - 1;
    }
    ConsumerSync();
    mark(kDependency);
    // The statistics of the LayerNorm that the previous phase finished have no reader left.
    if ((task.phase == 1 || task.phase == 3) && task.local == 0) {
      double* st = p.buf.stats + (task.phase == 3 ? 2 * p.m_pad : 0);
      for (int i = threadIdx.x; i < 2 * m; i += kConsumerWarps * 32) st[i] = 0.0;
    }
    const LayerWeights& lw = p.args.weights[task.layer];
    const __nv_bfloat16* a;
    int lda;
    switch (task.phase) {
      case 0:
        if (task.layer == 0) {
          a = p.args.ctx;
          lda = kD;
        } else {
          a = p.args.qkv_out;
          lda = kQkv;
        }
        break;
      case 1: a = p.buf.xb; lda = kD; break;
      case 2: a = p.buf.gb; lda = kF; break;
      default: a = p.buf.yb; lda = kD; break;
    }
    a += geo.b0 * 32;
    const int bytes = geo.nt * geo.nb * 512;
    int start = head;
    if (start % ring_bytes + bytes > ring_bytes) start += ring_bytes - start % ring_bytes;
    head = start + bytes;
    MbarWait(&full[j % kInFlight], (j / kInFlight) & 1);
    mark(kWeights);
    const uint4* w_smem = reinterpret_cast<const uint4*>(ring + start % ring_bytes);
    const int lane = threadIdx.x & 31, mw = warp & 3;
    const int g = lane >> 2, t = lane & 3;
    float acc[kMaxNt][4];
    for (int mb = 0; mb < m; mb += 64) {
      GemmBlock<kInstrumented>(acc, a, lda, geo.nb, (geo.tile * 5) % geo.nb, w_smem, geo.nt, mb, m,
                               p.args.debug_flags);
      if (kh == 1) {
#pragma unroll
        for (int nt = 0; nt < kMaxNt; ++nt)
          if (nt < geo.nt) reduce[(mw * kMaxNt + nt) * 32 + lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
      }
      ConsumerSync();
      if (kh == 0) {
#pragma unroll
        for (int nt = 0; nt < kMaxNt; ++nt) {
          if (nt < geo.nt) {
            const float4 o = reduce[(mw * kMaxNt + nt) * 32 + lane];
            acc[nt][0] += o.x;
            acc[nt][1] += o.y;
            acc[nt][2] += o.z;
            acc[nt][3] += o.w;
          }
        }
        if (pp.splits == 1) {
          Epilogue(p, task.layer, task.phase, geo.g0, geo.nt, mb, acc);
        } else {
          const int r_lo = mb + mw * 16 + g, r_hi = r_lo + 8;
#pragma unroll
          for (int nt = 0; nt < kMaxNt; ++nt) {
            if (nt < geo.nt) {
              float* base = p.buf.partial + size_t(geo.split) * p.m_pad * pp.n + (geo.g0 + nt) * 8 + 2 * t;
              if (r_lo < m) __stcg(reinterpret_cast<float2*>(base + size_t(r_lo) * pp.n), make_float2(acc[nt][0], acc[nt][1]));
              if (r_hi < m) __stcg(reinterpret_cast<float2*>(base + size_t(r_hi) * pp.n), make_float2(acc[nt][2], acc[nt][3]));
            }
          }
        }
      }
      ConsumerSync();
    }
    mark(kGemm);
    ++j;  // every warp is past the last ConsumerSync: the task's ring region is free; thread 0 refills
          // it after the signal, so the copies it issues do not delay the ticket and the signal

    bool finisher = true;
    if (pp.splits > 1) {  // the last task of the tile to arrive sums the partials in split order
      if (threadIdx.x == 0) {
        int* ticket = p.buf.tickets + q * kMaxTiles + geo.tile;
        const int last = AtomAddAcqRel(ticket, 1) == pp.splits - 1;
        if (last) *ticket = 0;
        *flag = last;
      }
      ConsumerSync();
      mark(kTicket);
      finisher = *flag != 0;
      if (finisher) {
        for (int mb = 0; mb < m; mb += 64) {
          if (kh == 0) {
            const int r_lo = mb + mw * 16 + g, r_hi = r_lo + 8;
#pragma unroll
            for (int nt = 0; nt < kMaxNt; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            for (int s = 0; s < pp.splits; ++s) {
              const float* base = p.buf.partial + size_t(s) * p.m_pad * pp.n + geo.g0 * 8 + 2 * t;
#pragma unroll
              for (int nt = 0; nt < kMaxNt; ++nt) {
                if (nt < geo.nt) {
                  if (r_lo < m) {
                    const float2 v = __ldcg(reinterpret_cast<const float2*>(base + size_t(r_lo) * pp.n + nt * 8));
                    acc[nt][0] += v.x;
                    acc[nt][1] += v.y;
                  }
                  if (r_hi < m) {
                    const float2 v = __ldcg(reinterpret_cast<const float2*>(base + size_t(r_hi) * pp.n + nt * 8));
                    acc[nt][2] += v.x;
                    acc[nt][3] += v.y;
                  }
                }
              }
            }
            Epilogue(p, task.layer, task.phase, geo.g0, geo.nt, mb, acc);
          }
        }
      }
      ConsumerSync();  // *flag is read by all before the next task may write it
    }
    mark(kEpilogue);
    if (finisher) {
      if (task.phase == 0 || task.phase == 2) {  // meet the phase's other tiles, then normalise ours
        ConsumerSync();
        if (threadIdx.x == 0) {
          int* meet = &counters[task.layer * kCountersPerLayer + 4 + task.phase];
          RedRelease(meet, 1);
          while (LoadAcquire(meet) < pp.tiles) {
          }
        }
        ConsumerSync();
        mark(kMet);
        NormalizeTile(p, lw, task.phase, geo.g0, geo.nt);
      }
      ConsumerSync();
      mark(kNormalized);
      if (threadIdx.x == 0) {
        int* done = &counters[task.layer * kCountersPerLayer + task.phase];
        if (!kInstrumented || p.args.trace == nullptr) {
          RedRelease(done, 1);
        } else if (AtomAddRelease(done, 1) == pp.tiles - 1) {
          p.args.trace[q + 1] = GlobalTimer();  // the moment phase q completed
        }
      }
    }
    mark(kSignalled);
    if (threadIdx.x == 0) {
      tail = head;
      issue();
    }
    mark(kIssued);
    if (traced) {  // moments a task skips (no ticket, no meeting) take the previous one's time
      uint64_t* rec = p.args.trace + 1 + kPhases * kMaxLayers + (size_t(q) * grid + blockIdx.x) * kTraceFields;
      rec[0] = 1u | (finisher ? 2u : 0u);
      rec[1] = stamp[0];
      for (int i = 1; i < kMoments; ++i) {
        if (stamp[i] == 0) stamp[i] = stamp[i - 1];
        rec[1 + i] = stamp[i];
      }
    }
  }

  // The last CTA out resets every counter for the next launch (same stream: nothing else runs).
  if (threadIdx.x == 0) {
    int* finished = counters + kMaxLayers * kCountersPerLayer;
    __threadfence();
    if (atomicAdd(finished, 1) == grid - 1) {
      for (int i = 0; i < p.args.layers * kCountersPerLayer; ++i) counters[i] = 0;
      *finished = 0;
      __threadfence();
    }
  }
}

int g_sm_count = 0;
int g_smem_limit = 0;

void Phases(const Plan& plan, PhasePlan* ph) {
  static const int kUnits[kPhases] = {kD / 8, kF / 8, kD / 8, kQkv / 8};
  static const int kUnitGroups[kPhases] = {1, 2, 1, 1};
  static const int kKb[kPhases] = {kD / 32, kD / 32, kF / 32, kD / 32};
  static const int kN[kPhases] = {kD, 2 * kF, kD, kQkv};
  for (int i = 0; i < kPhases; ++i) {
    ph[i].tiles = plan.tiles[i];
    ph[i].splits = plan.splits[i];
    ph[i].units = kUnits[i];
    ph[i].unit_groups = kUnitGroups[i];
    ph[i].kb = kKb[i];
    ph[i].n = kN[i];
  }
}

size_t PartialFloats(const PhasePlan* ph, int m_pad) {
  size_t best = 0;
  for (int i = 0; i < kPhases; ++i)
    if (ph[i].splits > 1) {
      const size_t f = size_t(ph[i].splits) * m_pad * ph[i].n;
      best = f > best ? f : best;
    }
  return best;
}

// Largest task in bytes of weights, or -1 if the plan is not valid.
int MaxTaskBytes(const PhasePlan* ph) {
  int best = 0;
  for (int i = 0; i < kPhases; ++i) {
    const PhasePlan& pp = ph[i];
    if (pp.tiles < 1 || pp.tiles > pp.units || pp.tiles > kMaxTiles || pp.splits < 1 || pp.splits > pp.kb) return -1;
    const int nt = CeilDiv(pp.units, pp.tiles) * pp.unit_groups;
    if (nt > kMaxNt) return -1;
    const int bytes = nt * CeilDiv(pp.kb, pp.splits) * 512;
    best = bytes > best ? bytes : best;
  }
  return best;
}

}  // namespace

void DefaultPlan(int m, Plan* plan) {
  (void)m;
  // the best of the plans measured on the H200 (round 10): see benchmarks/results/persistent-h200.md
  static const int kTiles[kPhases] = {64, 132, 64, 128};
  static const int kSplits[kPhases] = {2, 1, 2, 1};
  for (int i = 0; i < kPhases; ++i) {
    plan->tiles[i] = kTiles[i];
    plan->splits[i] = kSplits[i];
  }
}

size_t WorkspaceBytes(int m, const Plan& plan) {
  PhasePlan ph[kPhases];
  Phases(plan, ph);
  const int m_pad = CeilDiv(m, 64) * 64;
  return ZeroedBytes(m_pad) + Align256(PartialFloats(ph, m_pad) * sizeof(float)) +
         Align256(size_t(m_pad) * kD * sizeof(float)) + Align256(size_t(m_pad) * kD * 2) +
         Align256(size_t(m_pad) * kF * 2) + Align256(size_t(m_pad) * kD * 2);
}

int InitWorkspace(void* workspace, int m, void* stream) {
  return static_cast<int>(
      cudaMemsetAsync(workspace, 0, ZeroedBytes(CeilDiv(m, 64) * 64), static_cast<cudaStream_t>(stream)));
}

int Launch(const Args& args, const Plan& plan, void* workspace, void* stream, int grid_override) {
  if (args.layers < 1 || args.layers > kMaxLayers || args.m < 1 || args.m > 512) return int(cudaErrorInvalidValue);
  if (g_sm_count == 0) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e != cudaSuccess) return int(e);
    cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, device);
    cudaDeviceGetAttribute(&g_smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    e = cudaFuncSetAttribute(PersistentLayerKernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, g_smem_limit);
    if (e != cudaSuccess) return int(e);
    e = cudaFuncSetAttribute(PersistentLayerKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, g_smem_limit);
    if (e != cudaSuccess) return int(e);
  }
  const int grid = grid_override > 0 ? grid_override : g_sm_count;
  KernelParams p{};
  p.args = args;
  p.m = args.m;
  p.m_pad = CeilDiv(args.m, 64) * 64;
  Phases(plan, p.ph);
  const int max_task = MaxTaskBytes(p.ph);
  if (max_task < 0) return int(cudaErrorInvalidValue);
  // phases 0 and 2 meet inside the phase: each of their tasks must be on its own CTA
  if (plan.tiles[0] * plan.splits[0] > grid || plan.tiles[2] * plan.splits[2] > grid) return int(cudaErrorInvalidValue);
  p.ring_bytes = ((g_smem_limit - kSmemFixed) / 1024) * 1024;
  if (max_task > p.ring_bytes) return int(cudaErrorInvalidValue);
  p.buf = Carve(workspace, p.m_pad, PartialFloats(p.ph, p.m_pad));
  p.prefix[0] = 0;
  for (int i = 0; i < kPhases; ++i) p.prefix[i + 1] = p.prefix[i] + plan.tiles[i] * plan.splits[i];
  const size_t smem = size_t(kSmemFixed) + size_t(p.ring_bytes);
  if (args.trace != nullptr || args.debug_flags != 0) {
    PersistentLayerKernel<true><<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  } else {
    PersistentLayerKernel<false><<<grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p);
  }
  return int(cudaGetLastError());
}

}  // namespace persistent
}  // namespace omnigraph

// C entry points for the benchmark (ctypes) and, later, the op library.
// plan8: tiles[4] then splits[4]; null = the default plan for m.
namespace {
omnigraph::persistent::Plan ReadPlan(int m, const int* plan8) {
  omnigraph::persistent::Plan plan;
  if (plan8 == nullptr) {
    omnigraph::persistent::DefaultPlan(m, &plan);
  } else {
    for (int i = 0; i < omnigraph::persistent::kPhases; ++i) {
      plan.tiles[i] = plan8[i];
      plan.splits[i] = plan8[omnigraph::persistent::kPhases + i];
    }
  }
  return plan;
}
}  // namespace

extern "C" {
__attribute__((visibility("default"))) size_t omnigraph_persistent_workspace_bytes(int m, const int* plan8) {
  return omnigraph::persistent::WorkspaceBytes(m, ReadPlan(m, plan8));
}
__attribute__((visibility("default"))) int omnigraph_persistent_init_workspace(void* ws, int m, void* stream) {
  return omnigraph::persistent::InitWorkspace(ws, m, stream);
}
// layer_ptrs: layers x 6 device pointers (wo, wi, wo_mlp, wqkv packed; mlp_norm, attn_norm fp32).
__attribute__((visibility("default"))) int omnigraph_persistent_launch(int m, int layers, const int* plan8, float eps,
                                                                       const void* ctx, const float* h_in,
                                                                       float* h_out, void* qkv_out,
                                                                       const uint64_t* layer_ptrs, void* workspace,
                                                                       void* stream, int grid, uint64_t* trace,
                                                                       int debug_flags) {
  using namespace omnigraph::persistent;
  if (layers < 1 || layers > kMaxLayers) return int(cudaErrorInvalidValue);
  Args a{};
  a.m = m;
  a.layers = layers;
  a.epsilon = eps;
  a.ctx = static_cast<const __nv_bfloat16*>(ctx);
  a.h_in = h_in;
  a.h_out = h_out;
  a.qkv_out = static_cast<__nv_bfloat16*>(qkv_out);
  a.trace = trace;
  a.debug_flags = debug_flags;
  for (int l = 0; l < layers; ++l) {
    const uint64_t* q = layer_ptrs + 6 * l;
    a.weights[l].wo = reinterpret_cast<const __nv_bfloat16*>(q[0]);
    a.weights[l].wi = reinterpret_cast<const __nv_bfloat16*>(q[1]);
    a.weights[l].wo_mlp = reinterpret_cast<const __nv_bfloat16*>(q[2]);
    a.weights[l].wqkv = reinterpret_cast<const __nv_bfloat16*>(q[3]);
    a.weights[l].mlp_norm = reinterpret_cast<const float*>(q[4]);
    a.weights[l].attn_norm = reinterpret_cast<const float*>(q[5]);
  }
  return Launch(a, ReadPlan(m, plan8), workspace, stream, grid);
}
__attribute__((visibility("default"))) const char* omnigraph_persistent_error(int e) {
  return cudaGetErrorString(static_cast<cudaError_t>(e));
}
}
