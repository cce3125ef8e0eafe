// The floor of issue 19's design family, measured: what a one-kernel Laya encoder at batch 1 pays
// before it multiplies anything.
//
// A persistent grid (one CTA per SM, all resident: a cooperative launch, or as many whole clusters
// as fit at once) runs the 140 dependent steps of 28 layers with no arithmetic. Each layer is five
// steps, in order:
//   Wqkv (K 1024 -> N 3072), attention (per head), Wo (1024 -> 1024), Wi (1024 -> 5248),
//   Wo_mlp (2624 -> 1024).
// A step, on every CTA:
//   1. it waits until every CTA has signalled the step before (`Signal`: a counter or flags);
//   2. it reads its share of the step's input A, which the step before wrote;
//   3. it writes its tile of the output: BF16 stores or, with K split, FP32 red.add partials;
//   4. it takes its share of the step's weights from a shared-memory ring that a producer warp
//      fills from HBM as far ahead as the ring allows (cp.async.bulk), independent of the chain;
//   5. it signals.
// Every simplification makes the floor lower than a real kernel's, never higher: no MMA, no
// LayerNorm statistics, no attention arithmetic, the consumer's LayerNorm and GeGLU are free, and
// `share d` cases let each CTA read only 1/d of A (a lower bound for any d-CTA cluster that
// multicasts A, which reads A from L2 d times less but still lands all of it in every SM); the
// `multicast` cases are such clusters: each CTA copies 1/d of every A chunk into all d CTAs'
// shared memory (cp.async.bulk .multicast::cluster), and a chunk's stage is refilled only after
// all d CTAs have read it.
//
// The time of one forward is the in-kernel span: the first CTA's start to the last CTA's end
// (%globaltimer), median over launches. It prints a table and writes JSON rows:
//   chain_floor --json PATH [--rows 64,176,512] [--launches 20]
// Built and run on the GPU machine by benchmarks/gpu/chain_floor_run.sh.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "hopper_ptx.cuh"

namespace {

using hopper_ptx::BulkLoad;
using hopper_ptx::GlobalTimer;
using hopper_ptx::LoadAcquire;
using hopper_ptx::LoadRelaxed;
using hopper_ptx::MbarExpectTx;
using hopper_ptx::MbarInit;
using hopper_ptx::MbarWait;
using hopper_ptx::RedRelease;
using hopper_ptx::SmemAddr;
using hopper_ptx::StoreRelaxed;
using hopper_ptx::StoreRelease;

constexpr int kLayers = 28;
constexpr int kStepsPerLayer = 5;
constexpr int kSteps = kLayers * kStepsPerLayer;
constexpr int kConsumerWarps = 8;
constexpr int kThreads = (kConsumerWarps + 1) * 32;  // + one producer warp for the weights
constexpr uint32_t kChunk = 16 * 1024;               // bytes per bulk copy: large enough to amortise its issue
constexpr int kAStages = 4;                          // A ring: 64 KB
constexpr int kWStages = 8;                          // weight ring: 128 KB, about 70% of a layer's share per SM
constexpr int kHeads = 16;
constexpr int kHeadDim = 64;

// Per step of a layer: the input's columns when the step before wrote BF16 (its epilogue done), or
// FP32 partial sums (K split: the consumer finishes the epilogue, e.g. GeGLU needs gate and up),
// the output's columns, and the weight bytes. Attention reads, per head and per 1/8 of the query
// rows, that head's K and V for all rows plus its share of Q: 2 x 64 + 64 / 8 = 136 columns.
struct StepShape {
  int k_bf16;
  int k_fp32;
  int n;
  int64_t weight_bytes;
};
constexpr int kAttentionColumns = 2 * kHeadDim + kHeadDim / 8;
__constant__ StepShape kShapes[kStepsPerLayer] = {
    {1024, 1024, 3072, 3072LL * 1024 * 2},                                  // Wqkv
    {kAttentionColumns, kAttentionColumns, kHeads * kHeadDim, 0},            // attention
    {1024, 1024, 1024, 1024LL * 1024 * 2},                                  // Wo
    {1024, 1024, 5248, 5248LL * 1024 * 2},                                  // Wi (gate and up)
    {2624, 5248, 1024, 1024LL * 2624 * 2},                                  // Wo_mlp
};
constexpr int64_t kLayerWeightBytes = (3072LL + 1024 + 5248) * 1024 * 2 + 1024LL * 2624 * 2;

enum class AMode : int { kNone = 0, kPlain = 1, kBulk = 2 };

// How a step's completion travels. kCounter: every thread fences, then thread 0 adds 1 to the
// step's counter (red.release) and the next step's thread 0 polls it until it reaches the grid:
// the CTAs' additions meet at one address. kFlags: thread 0 alone publishes the step in its CTA's
// own flag (st.release, one 128-byte line per CTA) after the CTA's barrier, and the next step's
// first `grid` threads each poll one CTA's flag: no address is written by two CTAs. kRelaxed: the
// flags with relaxed stores and loads, no release or acquire: what a protocol pays whose every
// store carries its own flag (NCCL's LL: 4 bytes of data and 4 of flag per 8-byte store), so that
// seeing the flag is seeing the data and no fence is needed, at twice the bytes.
enum class Signal : int { kCounter = 0, kFlags = 1, kRelaxed = 2 };
constexpr int kFlagStride = 32;  // ints: one 128-byte line per CTA

struct Config {
  int rows = 64;
  AMode a_mode = AMode::kBulk;
  int share = 1;    // each CTA reads 1/share of A
  int ksplit = 1;   // > 1: projections split K this many ways (A / ksplit per CTA, FP32 red.add out)
  bool chain = true;
  bool writes = true;
  bool weights = false;
  int cluster = 1;  // > 1: A multicast across clusters of this many CTAs
  Signal signal = Signal::kCounter;
  bool l2_prefetch = false;  // the producer also prefetches the next layer's weights into L2
};

struct Buffers {
  char* act[2];            // ping-pong activations, FP32-sized
  const char* weights;     // kLayers x kLayerWeightBytes
  int* counters;           // one per step
  int* flags;              // kFlagStride ints per CTA: the last step it finished
  unsigned long long* span;  // [min start, max end], %globaltimer ns
};

__device__ inline void MbarArrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(SmemAddr(bar)) : "memory");
}
__device__ inline void MulticastCopy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;" ::"r"(
          SmemAddr(smem)),
      "l"(gmem), "r"(bytes), "r"(SmemAddr(bar)), "h"(mask)
      : "memory");
}
// Arrive on the barrier at the same shared-memory offset in cluster CTA `rank`.
__device__ inline void MbarArriveRemote(uint64_t* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(SmemAddr(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
__device__ inline uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ inline void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ inline void PrefetchL2(const void* gmem, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(gmem), "r"(bytes) : "memory");
}
__device__ inline void ConsumerSync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerWarps * 32) : "memory"); }

__host__ __device__ inline int64_t RoundDown16(int64_t bytes) { return bytes & ~int64_t{15}; }
// The bytes of the next copy when `left` remain: a whole chunk or the rest.
__device__ inline uint32_t ChunkBytes(int64_t left) { return static_cast<uint32_t>(left < kChunk ? left : kChunk); }

// What one CTA reads and writes in one step.
struct StepWork {
  int64_t a_offset, a_bytes;      // in the input activation buffer
  int64_t out_offset, out_bytes;  // in the output activation buffer
  bool out_fp32;                  // red.add partials instead of stores
};

__device__ StepWork Work(const Config& cfg, int step_in_layer, bool in_fp32, int cta, int grid) {
  const StepShape s = kShapes[step_in_layer];
  const bool attention = s.weight_bytes == 0;
  const int ksplit = attention ? 1 : cfg.ksplit;
  const int elt = in_fp32 ? 4 : 2;
  const int64_t a_total = int64_t{cfg.rows} * (in_fp32 ? s.k_fp32 : s.k_bf16) * elt;
  const int slices = cfg.share * ksplit;
  StepWork w;
  w.a_bytes = RoundDown16(a_total / slices);
  w.a_offset = (cta % slices) * w.a_bytes;
  w.out_fp32 = ksplit > 1;
  const int tiles = grid / ksplit;
  const int tile = cta / ksplit;
  const int64_t out_total = int64_t{cfg.rows} * s.n * (w.out_fp32 ? 4 : 2);
  w.out_bytes = tile < tiles ? RoundDown16(out_total / tiles) : 0;
  w.out_offset = tile * w.out_bytes;
  return w;
}

__device__ int64_t WeightShare(int step_in_layer, int grid) {
  return RoundDown16(kShapes[step_in_layer].weight_bytes / grid);
}

// This CTA's share of every step of `layer`, prefetched into L2 (a layer's weights, 24.5 MB, are
// half of the H100's and H200's 50 MB L2).
__device__ void PrefetchLayer(const Buffers& buf, int layer, int grid) {
  int64_t step_base = 0;
  for (int s = 0; s < kStepsPerLayer; ++s) {
    const int64_t share = WeightShare(s, grid);
    const char* src = buf.weights + layer * kLayerWeightBytes + step_base + blockIdx.x * share;
    for (int64_t done = 0; done < share; done += kChunk)
      PrefetchL2(src + done, ChunkBytes(share - done));
    step_base += kShapes[s].weight_bytes;
  }
}

// The producer warp's lane 0: the weights of every step, in order, through the ring.
__device__ void StreamWeights(const Config& cfg, const Buffers& buf, int grid, char* ring, uint64_t* full,
                              uint64_t* empty) {
  uint32_t chunk_index = 0;
  if (cfg.l2_prefetch) PrefetchLayer(buf, 0, grid);
  for (int layer = 0; layer < kLayers; ++layer) {
    if (cfg.l2_prefetch && layer + 1 < kLayers) PrefetchLayer(buf, layer + 1, grid);
    const char* layer_weights = buf.weights + layer * kLayerWeightBytes;
    int64_t step_base = 0;
    for (int s = 0; s < kStepsPerLayer; ++s) {
      const int64_t share = WeightShare(s, grid);
      const char* src = layer_weights + step_base + blockIdx.x * share;
      for (int64_t done = 0; done < share; done += kChunk, ++chunk_index) {
        const int stage = chunk_index % kWStages;
        const uint32_t round = chunk_index / kWStages;
        if (round > 0) MbarWait(&empty[stage], (round - 1) & 1);
        const uint32_t bytes = ChunkBytes(share - done);
        MbarExpectTx(&full[stage], bytes);
        BulkLoad(ring + stage * kChunk, src + done, bytes, &full[stage]);
      }
      step_base += kShapes[s].weight_bytes;
    }
  }
}

// Consumers: wait for the step's weight chunks to land and give their stages back.
__device__ void TakeWeights(int step_in_layer, int grid, uint32_t& chunk_index, uint64_t* full, uint64_t* empty) {
  const int64_t share = WeightShare(step_in_layer, grid);
  for (int64_t done = 0; done < share; done += kChunk, ++chunk_index) {
    const int stage = chunk_index % kWStages;
    MbarWait(&full[stage], (chunk_index / kWStages) & 1);
    if (threadIdx.x % 32 == 0) MbarArrive(&empty[stage]);
  }
}

// Plain loads: every consumer thread keeps 8 16-byte loads in flight (L2 only: A was written by
// other SMs in this launch).
__device__ uint32_t ReadPlain(const char* a, int64_t bytes) {
  uint32_t acc = 0;
  const int64_t vectors = bytes / 16;
  const int stride = kConsumerWarps * 32;
  for (int64_t i = threadIdx.x; i < vectors; i += 8 * stride) {
    int4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int64_t j = i + u * stride;
      v[u] = j < vectors ? __ldcg(reinterpret_cast<const int4*>(a) + j) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].w;
  }
  return acc;
}

// Bulk copies into the A ring, 16 KB each, thread 0 issuing; every consumer reads one word of each
// chunk and the stage is refilled after all of them passed. kMulticast: CTA `rank` of a cluster of
// `size` copies its 1/size of each chunk into every CTA of the cluster, each CTA's barrier expecting
// the whole chunk, and a stage is refilled once all `size` CTAs have arrived on the issuer's `empty`
// barrier for it.
template <bool kMulticast>
__device__ uint32_t ReadBulk(const char* a, int64_t bytes, char* ring, uint64_t* full, uint64_t* empty,
                             uint32_t& chunk_index, uint32_t rank, uint32_t size) {
  const int chunks = static_cast<int>((bytes + kChunk - 1) / kChunk);
  const uint16_t mask = static_cast<uint16_t>((1u << size) - 1);  // multicast: every CTA of the cluster
  auto issue = [&](int c) {
    const uint32_t index = chunk_index + c;
    const int stage = index % kAStages;
    const uint32_t n = ChunkBytes(bytes - int64_t{c} * kChunk);
    char* dst = ring + stage * kChunk;
    const char* src = a + int64_t{c} * kChunk;
    if constexpr (kMulticast) {
      if (index >= kAStages) MbarWait(&empty[stage], (index / kAStages - 1) & 1);
      const uint32_t piece = (n / size) & ~15u;
      const uint32_t begin = rank * piece;
      const uint32_t mine = rank + 1 == size ? n - begin : piece;
      MbarExpectTx(&full[stage], n);
      if (mine > 0) MulticastCopy(dst + begin, src + begin, mine, &full[stage], mask);
    } else {
      MbarExpectTx(&full[stage], n);
      BulkLoad(dst, src, n, &full[stage]);
    }
  };
  if (threadIdx.x == 0)
    for (int c = 0; c < chunks && c < kAStages; ++c) issue(c);
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const uint32_t index = chunk_index + c;
    const int stage = index % kAStages;
    MbarWait(&full[stage], (index / kAStages) & 1);
    acc ^= reinterpret_cast<const uint32_t*>(ring + stage * kChunk)[threadIdx.x];
    ConsumerSync();
    if (threadIdx.x == 0) {
      if constexpr (kMulticast)
        for (uint32_t r = 0; r < size; ++r) MbarArriveRemote(&empty[stage], r);
      if (c + kAStages < chunks) issue(c + kAStages);
    }
  }
  chunk_index += chunks;
  return acc;
}

__device__ void WriteTile(char* out, const StepWork& w, uint32_t value) {
  const int stride = kConsumerWarps * 32;
  const int64_t vectors = w.out_bytes / 16;
  if (w.out_fp32) {
    const float f = static_cast<float>(value & 0xff) * 1e-30f;
    for (int64_t i = threadIdx.x; i < vectors; i += stride)
      atomicAdd(reinterpret_cast<float4*>(out + w.out_offset) + i, make_float4(f, f, f, f));
  } else {
    const int4 v = make_int4(static_cast<int>(value), 0, 0, 0);
    for (int64_t i = threadIdx.x; i < vectors; i += stride)
      __stcg(reinterpret_cast<int4*>(out + w.out_offset) + i, v);
  }
}

__device__ void RunSteps(const Config& cfg, const Buffers& buf, int grid, uint32_t rank, char* a_ring,
                         uint64_t* a_full, uint64_t* a_empty, uint64_t* w_full, uint64_t* w_empty) {
  uint32_t a_chunks = 0, w_chunks = 0, acc = 0;
  bool in_fp32 = false;
  for (int step = 0; step < kSteps; ++step) {
    const int s = step % kStepsPerLayer;
    if (cfg.chain && step > 0) {
      if (cfg.signal == Signal::kCounter && threadIdx.x == 0)
        while (LoadAcquire(&buf.counters[step - 1]) < grid) {
        }
      if (cfg.signal == Signal::kFlags && threadIdx.x < grid)
        while (LoadAcquire(&buf.flags[threadIdx.x * kFlagStride]) < step) {
        }
      if (cfg.signal == Signal::kRelaxed && threadIdx.x < grid)
        while (LoadRelaxed(&buf.flags[threadIdx.x * kFlagStride]) < step) {
        }
      ConsumerSync();
    }
    const StepWork w = Work(cfg, s, in_fp32, blockIdx.x, grid);
    const char* in = buf.act[step % 2];
    char* out = buf.act[(step + 1) % 2];
    if (cfg.a_mode == AMode::kPlain) acc ^= ReadPlain(in + w.a_offset, w.a_bytes);
    if (cfg.a_mode == AMode::kBulk && cfg.cluster == 1)
      acc ^= ReadBulk<false>(in + w.a_offset, w.a_bytes, a_ring, a_full, a_empty, a_chunks, rank, 1);
    if (cfg.a_mode == AMode::kBulk && cfg.cluster > 1)
      acc ^= ReadBulk<true>(in + w.a_offset, w.a_bytes, a_ring, a_full, a_empty, a_chunks, rank, cfg.cluster);
    if (cfg.weights) TakeWeights(s, grid, w_chunks, w_full, w_empty);
    if (cfg.writes) WriteTile(out, w, acc);
    in_fp32 = w.out_fp32;
    if (cfg.chain && cfg.signal == Signal::kCounter) {
      __threadfence();
      ConsumerSync();
      if (threadIdx.x == 0) RedRelease(&buf.counters[step], 1);
    }
    if (cfg.chain && cfg.signal == Signal::kFlags) {
      ConsumerSync();
      if (threadIdx.x == 0) StoreRelease(&buf.flags[blockIdx.x * kFlagStride], step + 1);
    }
    if (cfg.chain && cfg.signal == Signal::kRelaxed) {
      ConsumerSync();
      if (threadIdx.x == 0) StoreRelaxed(&buf.flags[blockIdx.x * kFlagStride], step + 1);
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) ChainKernel(Config cfg, Buffers buf) {
  extern __shared__ __align__(128) char smem[];
  char* a_ring = smem;
  char* w_ring = smem + kAStages * kChunk;
  uint64_t* bars = reinterpret_cast<uint64_t*>(w_ring + kWStages * kChunk);
  uint64_t* a_full = bars;
  uint64_t* w_full = bars + kAStages;
  uint64_t* w_empty = w_full + kWStages;
  uint64_t* a_empty = w_empty + kWStages;
  const uint32_t rank = cfg.cluster > 1 ? ClusterRank() : 0;
  const int grid = gridDim.x;
  const int warp = threadIdx.x / 32;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kAStages; ++i) {
      MbarInit(&a_full[i], 1);
      MbarInit(&a_empty[i], cfg.cluster);
    }
    for (int i = 0; i < kWStages; ++i) {
      MbarInit(&w_full[i], 1);
      MbarInit(&w_empty[i], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (cfg.cluster > 1) ClusterSync();  // every CTA's barriers exist before a peer copies into them
  const unsigned long long start = GlobalTimer();

  if (warp == kConsumerWarps) {
    if (cfg.weights && threadIdx.x % 32 == 0) StreamWeights(cfg, buf, grid, w_ring, w_full, w_empty);
  } else {
    RunSteps(cfg, buf, grid, rank, a_ring, a_full, a_empty, w_full, w_empty);
  }
  if (cfg.cluster > 1) ClusterSync();  // no CTA leaves while a peer may still copy or arrive into it
  if (threadIdx.x == 0) {
    atomicMin(&buf.span[0], start);
    atomicMax(&buf.span[1], GlobalTimer());
  }
}

constexpr size_t kSmemBytes = (kAStages + kWStages) * kChunk + 2 * (kAStages + kWStages) * sizeof(uint64_t);

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct Case {
  const char* name;
  Config cfg;
};

std::vector<Case> Cases(int rows) {
  auto c = [rows](AMode a, int share, int ksplit, bool chain, bool writes, bool weights, int cluster = 1,
                  Signal signal = Signal::kCounter, bool l2_prefetch = false) {
    Config cfg;
    cfg.rows = rows;
    cfg.a_mode = a;
    cfg.share = share;
    cfg.ksplit = ksplit;
    cfg.chain = chain;
    cfg.writes = writes;
    cfg.weights = weights;
    cfg.cluster = cluster;
    cfg.signal = signal;
    cfg.l2_prefetch = l2_prefetch;
    return cfg;
  };
  return {
      {"signals only", c(AMode::kNone, 1, 1, true, false, false)},
      {"signals + output stores", c(AMode::kNone, 1, 1, true, true, false)},
      {"whole A, plain loads", c(AMode::kPlain, 1, 1, true, true, false)},
      {"whole A, bulk copies", c(AMode::kBulk, 1, 1, true, true, false)},
      {"A/2 per CTA, bulk", c(AMode::kBulk, 2, 1, true, true, false)},
      {"A/4 per CTA, bulk", c(AMode::kBulk, 4, 1, true, true, false)},
      {"A/8 per CTA, bulk", c(AMode::kBulk, 8, 1, true, true, false)},
      {"K split 2, bulk, red.add", c(AMode::kBulk, 1, 2, true, true, false)},
      {"K split 4, bulk, red.add", c(AMode::kBulk, 1, 4, true, true, false)},
      {"weights only (no chain)", c(AMode::kNone, 1, 1, false, false, true)},
      {"signals + stores + weights", c(AMode::kNone, 1, 1, true, true, true)},
      {"whole A, bulk + weights", c(AMode::kBulk, 1, 1, true, true, true)},
      {"A/4 per CTA, bulk + weights", c(AMode::kBulk, 4, 1, true, true, true)},
      {"K split 4, bulk + weights", c(AMode::kBulk, 1, 4, true, true, true)},
      {"flags: signals only", c(AMode::kNone, 1, 1, true, false, false, 1, Signal::kFlags)},
      {"flags: signals + stores + weights", c(AMode::kNone, 1, 1, true, true, true, 1, Signal::kFlags)},
      {"flags: whole A, bulk + weights", c(AMode::kBulk, 1, 1, true, true, true, 1, Signal::kFlags)},
      {"flags: A/4 per CTA, bulk + weights", c(AMode::kBulk, 4, 1, true, true, true, 1, Signal::kFlags)},
      {"flags: A/8 per CTA, bulk + weights", c(AMode::kBulk, 8, 1, true, true, true, 1, Signal::kFlags)},
      {"flags + L2: signals + stores + weights", c(AMode::kNone, 1, 1, true, true, true, 1, Signal::kFlags, true)},
      {"flags + L2: whole A, bulk + weights", c(AMode::kBulk, 1, 1, true, true, true, 1, Signal::kFlags, true)},
      {"flags + L2: A/4 per CTA, bulk + weights", c(AMode::kBulk, 4, 1, true, true, true, 1, Signal::kFlags, true)},
      {"counter + L2: signals + stores + weights", c(AMode::kNone, 1, 1, true, true, true, 1, Signal::kCounter, true)},
      {"relaxed: signals only", c(AMode::kNone, 1, 1, true, false, false, 1, Signal::kRelaxed)},
      {"relaxed: signals + stores", c(AMode::kNone, 1, 1, true, true, false, 1, Signal::kRelaxed)},
      {"relaxed: A/4 per CTA, bulk (LL's A/8)", c(AMode::kBulk, 4, 1, true, true, false, 1, Signal::kRelaxed)},
      {"relaxed: signals + stores + weights", c(AMode::kNone, 1, 1, true, true, true, 1, Signal::kRelaxed)},
      {"relaxed: A/4 per CTA, bulk + weights", c(AMode::kBulk, 4, 1, true, true, true, 1, Signal::kRelaxed)},
      {"flags: A/8 per CTA, bulk", c(AMode::kBulk, 8, 1, true, true, false, 1, Signal::kFlags)},
      {"flags: signals + stores", c(AMode::kNone, 1, 1, true, true, false, 1, Signal::kFlags)},
      {"whole A, multicast x2", c(AMode::kBulk, 1, 1, true, true, false, 2)},
      {"whole A, multicast x4", c(AMode::kBulk, 1, 1, true, true, false, 4)},
      {"whole A, multicast x2 + weights", c(AMode::kBulk, 1, 1, true, true, true, 2)},
      {"whole A, multicast x4 + weights", c(AMode::kBulk, 1, 1, true, true, true, 4)},
  };
}

cudaLaunchConfig_t LaunchConfig(int grid, int cluster, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

// The largest grid of whole clusters that is resident at once (the chain deadlocks otherwise).
int ResidentClusterGrid(int cluster, int sms) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = LaunchConfig(cluster, cluster, &attr);
  int clusters = 0;
  Check(cudaOccupancyMaxActiveClusters(&clusters, ChainKernel, &config), "cudaOccupancyMaxActiveClusters");
  return std::min(clusters * cluster, sms / cluster * cluster);
}

// Without clusters a cooperative launch, which refuses a grid that cannot be resident at once.
void Launch(Config cfg, Buffers buf, int grid) {
  if (cfg.cluster == 1) {
    void* args[] = {&cfg, &buf};
    Check(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(ChainKernel), grid, kThreads, args, kSmemBytes),
          "cooperative launch");
    return;
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = LaunchConfig(grid, cfg.cluster, &attr);
  Check(cudaLaunchKernelEx(&config, ChainKernel, cfg, buf), "cluster launch");
}

bool WriteJson(const std::string& path, const std::string& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::perror(path.c_str());
    return false;
  }
  std::fprintf(f, "[%s]\n", rows.c_str());
  std::fclose(f);
  return true;
}

double MedianUs(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> rows = {64, 176, 512};
  int launches = 20;
  std::string json_path, command = "chain_floor";
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--launches" && i + 1 < argc) {
      launches = std::atoi(argv[++i]);
    } else if (a == "--rows" && i + 1 < argc) {
      rows.clear();
      for (char* t = std::strtok(argv[++i], ","); t != nullptr; t = std::strtok(nullptr, ",")) rows.push_back(std::atoi(t));
    } else {
      std::fprintf(stderr, "usage: chain_floor --json PATH [--rows 64,176,512] [--launches 20]\n");
      return 2;
    }
  }
  if (launches < 1 || rows.empty() || *std::min_element(rows.begin(), rows.end()) < 1) {
    std::fprintf(stderr, "--launches and every --rows value must be positive\n");
    return 2;
  }
  cudaDeviceProp prop;
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  Check(cudaFuncSetAttribute(ChainKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), "smem attribute");
  Check(cudaFuncSetAttribute(ChainKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "cluster attribute");
  // CTAs per cluster size: one per SM, or as many whole clusters as can be resident at once
  std::map<int, int> grids = {{1, prop.multiProcessorCount}};
  for (int cluster : {2, 4}) grids[cluster] = ResidentClusterGrid(cluster, prop.multiProcessorCount);

  const int max_rows = *std::max_element(rows.begin(), rows.end());
  Buffers buf;
  // the widest activation any step reads or writes: Wi's FP32 partial sums, 5248 columns
  const int64_t act_bytes = int64_t{max_rows} * 5248 * 4 + (1 << 20);
  for (char*& a : buf.act) {
    Check(cudaMalloc(&a, act_bytes), "cudaMalloc act");
    Check(cudaMemset(a, 0, act_bytes), "memset act");
  }
  char* weights;
  Check(cudaMalloc(&weights, kLayers * kLayerWeightBytes), "cudaMalloc weights");
  Check(cudaMemset(weights, 1, kLayers * kLayerWeightBytes), "memset weights");
  buf.weights = weights;
  Check(cudaMalloc(&buf.counters, kSteps * sizeof(int)), "cudaMalloc counters");
  const size_t flag_bytes = size_t{kFlagStride} * prop.multiProcessorCount * sizeof(int);
  Check(cudaMalloc(&buf.flags, flag_bytes), "cudaMalloc flags");
  Check(cudaMalloc(&buf.span, 2 * sizeof(unsigned long long)), "cudaMalloc span");
  const unsigned long long span_init[2] = {~0ULL, 0ULL};

  std::printf("%s, %d SMs, %d threads per CTA, %zu B shared memory, %d launches per case\n", prop.name,
              prop.multiProcessorCount, kThreads, kSmemBytes, launches);
  std::printf("%-42s %6s %6s %12s %12s\n", "case", "M", "CTAs", "forward us", "us per step");
  std::string rows_json;
  for (int m : rows) {
    for (const Case& c : Cases(m)) {
      std::vector<double> spans;
      for (int l = 0; l < launches + 3; ++l) {
        Check(cudaMemsetAsync(buf.counters, 0, kSteps * sizeof(int)), "memset counters");
        Check(cudaMemsetAsync(buf.flags, 0, flag_bytes), "memset flags");
        Check(cudaMemcpyAsync(buf.span, span_init, sizeof(span_init), cudaMemcpyHostToDevice), "span init");
        Launch(c.cfg, buf, grids[c.cfg.cluster]);
        Check(cudaDeviceSynchronize(), c.name);
        unsigned long long span[2];
        Check(cudaMemcpy(span, buf.span, sizeof(span), cudaMemcpyDeviceToHost), "span read");
        if (l >= 3) spans.push_back((span[1] - span[0]) / 1000.0);
      }
      const double us = MedianUs(spans);
      std::printf("%-42s %6d %6d %12.1f %12.2f\n", c.name, m, grids[c.cfg.cluster], us, us / kSteps);
      char row[512];
      std::snprintf(row, sizeof(row),
                    "%s{\"case\": \"%s\", \"rows\": %d, \"metric\": \"forward_us\", \"value\": %.1f, \"unit\": \"us\", "
                    "\"us_per_step\": %.3f, \"steps\": %d, \"gpu\": \"%s\", \"ctas\": %d, \"command\": \"%s\"}",
                    rows_json.empty() ? "" : ",\n ", c.name, m, us, us / kSteps, kSteps, prop.name,
                    grids[c.cfg.cluster], command.c_str());
      rows_json += row;
      if (!json_path.empty() && !WriteJson(json_path, rows_json)) return 1;  // kept if a later case hangs
    }
  }
  return 0;
}
