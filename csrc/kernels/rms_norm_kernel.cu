// RMSNorm forward and backward (rms_norm.cuh). A row belongs to a group of `group` lanes of one
// warp (a power of two up to 32, sized to the row: 16 lanes for a 128-wide head norm, a full
// warp for hidden 1024 and up), so a 256-thread block works on 256 / group rows at once and the
// row's sum needs only warp shuffles, no __syncthreads. Rows move as 16-byte vectors when the
// hidden size and the pointers allow it, else one element at a time (the same kernel, V = 1).
//
// Loads in flight: a lane that loops over its vectors one at a time (a loop of unknown trip count,
// which nvcc does not unroll) waits out one memory latency per vector, and a (16384, 4096) bf16
// forward ran at 2.6 TB/s that way (0.104 ms, W4's profile on H200; copies move 4.3). Rows of up to
// kMaxCachedVectors vectors per lane (the forward) or kMaxCachedBackwardVectors (a frozen weight's
// backward: x and grad_y) are read into registers with every load issued before the first use,
// then written from there: each input read once, at the bandwidth of a copy.
//
// Backward, the weight gradient: a lane always owns the same columns (vectors lane, lane + group,
// ...), and x and grad_y of a row are read once into registers. Rows of up to 2 vectors per lane
// (head norms) keep the lane's weights and grad_weight sums in registers too. Rows of 3 to 8
// vectors per lane (hidden up to 2048 in bf16/fp16, 1024 in fp32; a full warp per row) add
// grad_weight into the warp's own shared-memory row instead: lanes own their columns there, so no
// atomics, and registers stay under 64 so four blocks fit an SM (kept in registers, those sums
// took 128 registers and ran at 1.1 TB/s, ncu on H200). Wider rows use the general kernel, which
// adds grad_weight into shared memory per element and reads x and grad_y twice. Every kernel
// writes one partial row per block for the caller to sum: no global atomics, and the order of
// additions changes the result only by float rounding.
#include "dtype_utils.cuh"
#include "rms_norm.cuh"
#include "warp_sums.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRegisterVectors = 2;  // grad_weight sums in registers up to this many vectors per lane
constexpr int kMaxWarpSumVectors = 8;   // in the warp's shared-memory row up to this many
constexpr int kMaxCachedVectors = 16;   // forward rows held in registers: 64 registers of x at 16
constexpr int kMaxCachedBackwardVectors = 16;  // frozen-weight backward: x and grad_y, 128 registers

// x's vector v of a row, with the row's residual added when there is one (round_to_T(x + r):
// what the separate add gives) and that sum stored for the caller (hasten::add_rms_norm).
// kAdd is whether p.residual is set: a template parameter, so that the kernels without the add
// compile as they did before it (a runtime branch cost the weight-gradient kernels spills).
template <typename T, int V, bool kAdd>
__device__ __forceinline__ void load_input(const RmsNormParams& p, int64_t offset, int64_t v, T (&chunk)[V]) {
  load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, chunk);
  if constexpr (!kAdd) return;
  T r[V];
  load_chunk<T, V>(static_cast<const T*>(p.residual) + offset, v, r);
#pragma unroll
  for (int i = 0; i < V; ++i) chunk[i] = from_float<T>(to_float(chunk[i]) + to_float(r[i]));
  store_chunk<T, V>(static_cast<T*>(p.sum) + offset, v, chunk);
}

// grad_add's vector v of a row as floats (zeros without grad_add): added to grad_x before its
// one rounding.
// kAdd: whether p.grad_add is set (as for load_input).
template <typename T, int V, bool kAdd>
__device__ __forceinline__ void load_grad_add(const RmsNormParams& p, int64_t offset, int64_t v, float (&out)[V]) {
  if constexpr (!kAdd) {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = 0.f;
    return;
  }
  T chunk[V];
  load_chunk<T, V>(static_cast<const T*>(p.grad_add) + offset, v, chunk);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(chunk[i]);
}

// The rows one group of lanes visits. Trips are per warp: warp_row (the first row of the warp's
// groups on this trip) is the same on all 32 lanes, so every lane takes the same trips through
// the row loop and reaches group_sum's shuffles together, also past the last row.
struct RowWalk {
  int64_t warp_row;   // first row of this warp's groups on the first trip
  int64_t step;       // rows between trips
  int group_in_warp;  // this group's row on a trip is warp_row + group_in_warp
  int lane;           // lane inside the group
};

__device__ __forceinline__ RowWalk row_walk(int group) {
  const int rows_per_warp = 32 / group;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  return {warp * rows_per_warp, static_cast<int64_t>(gridDim.x) * (kThreads / group),
          static_cast<int>(threadIdx.x % 32) / group, static_cast<int>(threadIdx.x % group)};
}

template <typename T, int V, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_forward_kernel(RmsNormParams p, int group) {
  const RowWalk walk = row_walk(group);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row + walk.group_in_warp;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    float squares = 0.f;
    if (active) {
#pragma unroll 4
      for (int64_t v = walk.lane; v < vectors; v += group) {
        T chunk[V];
        load_input<T, V, kAdd>(p, offset, v, chunk);
#pragma unroll
        for (int i = 0; i < V; ++i) squares += to_float(chunk[i]) * to_float(chunk[i]);
      }
    }
    const float rstd = rsqrtf(group_sum(squares, group) / static_cast<float>(p.hidden) + p.eps);
    if (!active) continue;
    if (walk.lane == 0) p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.hidden;
    // the normalised input: x, or the sum this lane stored above
    const T* x = static_cast<const T*>(kAdd ? p.sum : p.x) + offset;
#pragma unroll 4
    for (int64_t v = walk.lane; v < vectors; v += group) {
      T chunk[V], weight[V];
      load_chunk<T, V>(x, v, chunk);
      load_chunk<T, V>(w, v, weight);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float normalised = to_float(from_float<T>(to_float(chunk[i]) * rstd));
        chunk[i] = from_float<T>((to_float(weight[i]) + p.offset) * normalised);
      }
      store_chunk<T, V>(y, v, chunk);
    }
  }
}

// The forward for rows of at most K vectors per lane: the row's vectors are loaded into registers
// (all K loads issued before the sum needs the first), summed, normalised and stored from there.
// The same additions in the same order as rms_norm_forward_kernel: the same rstd and output.
// Two blocks an SM at K = 16 (registers capped at 128: without the cap nvcc hoists the weight's
// loads too, 152 registers, one block an SM). With the residual (kAdd), x and the residual of all
// K vectors are loaded before the first sum is stored: a store to p.sum may alias the inputs as far
// as nvcc knows, so loads after it wait for it, and storing each sum as it came (load_input) paid
// one memory latency per vector (W4's (16384, 4096) add + norm at 173 us, 3.0 TB/s); the two
// (K, V) arrays need more than 128 registers, so one block an SM there.
template <typename T, int V, int K, bool kAdd>
__global__ void __launch_bounds__(kThreads, (K >= 16 && !kAdd) ? 2 : 1)
    rms_norm_forward_cached_kernel(RmsNormParams p, int group) {
  // K > 1 means more vectors than lanes, so a whole warp: a constant stride lets the K loads
  // share one address register (immediate offsets)
  const int lanes = K > 1 ? 32 : group;
  const RowWalk walk = row_walk(lanes);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row + walk.group_in_warp;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    T xs[K][V];
    if constexpr (kAdd) {  // every load first, then round_to_T(x + r) and its store (as load_input)
      T rs[K][V];
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t v = walk.lane + k * lanes;
        if (!active || v >= vectors) continue;
        load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, xs[k]);
        load_chunk<T, V>(static_cast<const T*>(p.residual) + offset, v, rs[k]);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t v = walk.lane + k * lanes;
        if (!active || v >= vectors) continue;
#pragma unroll
        for (int i = 0; i < V; ++i) xs[k][i] = from_float<T>(to_float(xs[k][i]) + to_float(rs[k][i]));
        store_chunk<T, V>(static_cast<T*>(p.sum) + offset, v, xs[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t v = walk.lane + k * lanes;
        if (active && v < vectors) load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, xs[k]);
      }
    }
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + k * lanes;
      if (!active || v >= vectors) continue;
#pragma unroll
      for (int i = 0; i < V; ++i) squares += to_float(xs[k][i]) * to_float(xs[k][i]);
    }
    const float rstd = rsqrtf(group_sum(squares, lanes) / static_cast<float>(p.hidden) + p.eps);
    if (!active) continue;
    if (walk.lane == 0) p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.hidden;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + k * lanes;
      if (v >= vectors) continue;
      T weight[V];
      load_chunk<T, V>(w, v, weight);  // (hidden,): every row reads it, from L1/L2
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float normalised = to_float(from_float<T>(to_float(xs[k][i]) * rstd));
        xs[k][i] = from_float<T>((to_float(weight[i]) + p.offset) * normalised);
      }
      store_chunk<T, V>(y, v, xs[k]);
    }
  }
}

// Zeroes the block's grad_weight sums (hidden,) in shared memory.
__device__ __forceinline__ void zero_block_sums(float* sums, int64_t hidden) {
  for (int64_t c = threadIdx.x; c < hidden; c += kThreads) sums[c] = 0.f;
  __syncthreads();
}

// Writes the block's sums as its row of grad_weight_partial (blocks, hidden).
__device__ __forceinline__ void write_block_partial(const float* sums, const RmsNormParams& p) {
  __syncthreads();
  float* partial = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.hidden;
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) partial[c] = sums[c];
}

// Register-resident backward: the lane's vectors k = 0..K-1 are columns (lane + k * group) * V ..
// + V - 1 of every row it visits (those at or past `vectors` are skipped).
template <typename T, int V, int K, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_backward_registers_kernel(RmsNormParams p, int group) {
  extern __shared__ float block_grad_weight[];  // (hidden,)
  zero_block_sums(block_grad_weight, p.hidden);
  const RowWalk walk = row_walk(group);
  const int64_t vectors = p.hidden / V;
  T weight[K][V];
  float grad_weight[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = walk.lane + static_cast<int64_t>(k) * group;
    if (v < vectors) load_chunk<T, V>(static_cast<const T*>(p.weight), v, weight[k]);
#pragma unroll
    for (int i = 0; i < V; ++i) grad_weight[k][i] = 0.f;
  }
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row + walk.group_in_warp;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    const float rstd = active ? p.rstd[row] : 0.f;
    T xs[K][V], gs[K][V];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + static_cast<int64_t>(k) * group;
      if (!active || v >= vectors) continue;
      load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, xs[k]);
      load_chunk<T, V>(static_cast<const T*>(p.grad_y) + offset, v, gs[k]);
#pragma unroll
      for (int i = 0; i < V; ++i)
        dot += (to_float(weight[k][i]) + p.offset) * to_float(gs[k][i]) * (to_float(xs[k][i]) * rstd);
    }
    const float mean_dot = group_sum(dot, group) / static_cast<float>(p.hidden);
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + static_cast<int64_t>(k) * group;
      if (v >= vectors) continue;
      float add[V];
      load_grad_add<T, V, kAdd>(p, offset, v, add);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[k][i]) * rstd;
        const float gy = to_float(gs[k][i]);
        grad_weight[k][i] += gy * to_float(from_float<T>(n));
        xs[k][i] = from_float<T>(rstd * ((to_float(weight[k][i]) + p.offset) * gy - n * mean_dot) + add[i]);
      }
      store_chunk<T, V>(static_cast<T*>(p.y) + offset, v, xs[k]);
    }
  }
  // 256 / group lanes share each column: one shared-memory add per lane and column per block.
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t v = walk.lane + static_cast<int64_t>(k) * group;
    if (v >= vectors) continue;
#pragma unroll
    for (int i = 0; i < V; ++i) atomicAdd(&block_grad_weight[v * V + i], grad_weight[k][i]);
  }
  write_block_partial(block_grad_weight, p);
}

// A full warp per row, K (3..8) vectors per lane. The warp's grad_weight sums live in shared
// memory as (V, vectors): element i of vector v at i * vectors + v, so the 32 lanes (consecutive v)
// hit 32 different banks. Registers capped so that four blocks (K = 4) or two (K = 8) fit an SM.
// With grad_add (kAdd) one block fewer an SM: at the cap of the plain kernel it spilled.
template <typename T, int V, int K, bool kAdd>
__global__ void __launch_bounds__(kThreads, (K <= 4 ? 4 : 2) - (kAdd ? 1 : 0))
    rms_norm_backward_warp_sums_kernel(RmsNormParams p, int group) {
  extern __shared__ float warp_grad_weight[];  // (kWarps, V, vectors)
  const int64_t vectors = p.hidden / V;
  float* mine = warp_grad_weight + static_cast<int64_t>(threadIdx.x / 32) * p.hidden;
  for (int64_t c = threadIdx.x % 32; c < p.hidden; c += 32) mine[c] = 0.f;
  __syncwarp();
  const RowWalk walk = row_walk(group);  // group == 32: one row per warp and trip
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    const float rstd = active ? p.rstd[row] : 0.f;
    T xs[K][V], gs[K][V];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + static_cast<int64_t>(k) * 32;
      if (!active || v >= vectors) continue;
      T ws[V];
      load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, xs[k]);
      load_chunk<T, V>(static_cast<const T*>(p.grad_y) + offset, v, gs[k]);
      load_chunk<T, V>(w, v, ws);
#pragma unroll
      for (int i = 0; i < V; ++i)
        dot += (to_float(ws[i]) + p.offset) * to_float(gs[k][i]) * (to_float(xs[k][i]) * rstd);
    }
    const float mean_dot = group_sum(dot, 32) / static_cast<float>(p.hidden);
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + static_cast<int64_t>(k) * 32;
      if (v >= vectors) continue;
      T ws[V];
      load_chunk<T, V>(w, v, ws);  // the weight row stays in L1: 2-4 KB read by every row
      float add[V];
      load_grad_add<T, V, kAdd>(p, offset, v, add);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[k][i]) * rstd;
        const float gy = to_float(gs[k][i]);
        mine[i * vectors + v] += gy * to_float(from_float<T>(n));
        xs[k][i] = from_float<T>(rstd * ((to_float(ws[i]) + p.offset) * gy - n * mean_dot) + add[i]);
      }
      store_chunk<T, V>(static_cast<T*>(p.y) + offset, v, xs[k]);
    }
  }
  __syncthreads();
  float* partial = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.hidden;
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) {
    const int64_t at = (c % V) * vectors + c / V;
    float sum = 0.f;
#pragma unroll
    for (int warp = 0; warp < kWarps; ++warp) sum += warp_grad_weight[warp * p.hidden + at];
    partial[c] = sum;
  }
}

// General backward for rows of any width: x and grad_y are read twice per row, and grad_weight
// is added into shared memory per element. WeightGrad false (no grad_weight_partial: a frozen
// weight) drops those adds and the partials: grad_x alone, a streaming pass.
template <typename T, int V, bool WeightGrad, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_backward_kernel(RmsNormParams p, int group) {
  extern __shared__ float block_grad_weight[];  // (hidden,) with WeightGrad
  if (WeightGrad) zero_block_sums(block_grad_weight, p.hidden);
  const RowWalk walk = row_walk(group);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row + walk.group_in_warp;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    const T* x = static_cast<const T*>(p.x) + offset;
    const T* g = static_cast<const T*>(p.grad_y) + offset;
    const float rstd = active ? p.rstd[row] : 0.f;
    float dot = 0.f;
    if (active) {
#pragma unroll 4
      for (int64_t v = walk.lane; v < vectors; v += group) {
        T xs[V], gs[V], ws[V];
        load_chunk<T, V>(x, v, xs);
        load_chunk<T, V>(g, v, gs);
        load_chunk<T, V>(w, v, ws);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float n = to_float(xs[i]) * rstd;
          dot += (to_float(ws[i]) + p.offset) * to_float(gs[i]) * n;
        }
      }
    }
    const float mean_dot = group_sum(dot, group) / static_cast<float>(p.hidden);
    if (!active) continue;
    T* gx = static_cast<T*>(p.y) + offset;
#pragma unroll 4
    for (int64_t v = walk.lane; v < vectors; v += group) {
      T xs[V], gs[V], ws[V];
      float add[V];
      load_chunk<T, V>(x, v, xs);
      load_chunk<T, V>(g, v, gs);
      load_chunk<T, V>(w, v, ws);
      load_grad_add<T, V, kAdd>(p, offset, v, add);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[i]) * rstd;
        const float gy = to_float(gs[i]);
        if (WeightGrad) atomicAdd(&block_grad_weight[v * V + i], gy * to_float(from_float<T>(n)));
        xs[i] = from_float<T>(rstd * ((to_float(ws[i]) + p.offset) * gy - n * mean_dot) + add[i]);
      }
      store_chunk<T, V>(gx, v, xs);
    }
  }
  if (WeightGrad) write_block_partial(block_grad_weight, p);
}

// The backward of a frozen weight (no grad_weight) for rows of at most K vectors per lane: x and
// grad_y of the row (and grad_add, kAdd) loaded into registers, every load issued first; grad_x
// stored from there. The same arithmetic in the same order as rms_norm_backward_kernel<T, V, false>.
// grad_add is loaded up front too: read next to the stores of grad_x (which may alias it as far as
// nvcc knows), each vector waited out one memory latency (W4's (16384, 4096) at 231 us, 2.2 TB/s).
template <typename T, int V, int K, bool kAdd>
__global__ void __launch_bounds__(kThreads) rms_norm_backward_cached_kernel(RmsNormParams p, int group) {
  // K > 1 means more vectors than lanes, so a whole warp: a constant stride lets the K loads
  // share one address register (immediate offsets)
  const int lanes = K > 1 ? 32 : group;
  const RowWalk walk = row_walk(lanes);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t warp_row = walk.warp_row; warp_row < p.rows; warp_row += walk.step) {
    const int64_t row = warp_row + walk.group_in_warp;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    const float rstd = active ? p.rstd[row] : 0.f;
    T xs[K][V], gs[K][V];
    T adds[kAdd ? K : 1][V];  // grad_add's vectors (unused without it)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + k * lanes;
      if (!active || v >= vectors) continue;
      load_chunk<T, V>(static_cast<const T*>(p.x) + offset, v, xs[k]);
      load_chunk<T, V>(static_cast<const T*>(p.grad_y) + offset, v, gs[k]);
      if constexpr (kAdd) load_chunk<T, V>(static_cast<const T*>(p.grad_add) + offset, v, adds[k]);
    }
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + k * lanes;
      if (!active || v >= vectors) continue;
      T ws[V];
      load_chunk<T, V>(w, v, ws);
#pragma unroll
      for (int i = 0; i < V; ++i)
        dot += (to_float(ws[i]) + p.offset) * to_float(gs[k][i]) * (to_float(xs[k][i]) * rstd);
    }
    const float mean_dot = group_sum(dot, lanes) / static_cast<float>(p.hidden);
    if (!active) continue;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t v = walk.lane + k * lanes;
      if (v >= vectors) continue;
      T ws[V];
      load_chunk<T, V>(w, v, ws);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[k][i]) * rstd;
        const float add = kAdd ? to_float(adds[kAdd ? k : 0][i]) : 0.f;
        xs[k][i] = from_float<T>(rstd * ((to_float(ws[i]) + p.offset) * to_float(gs[k][i]) - n * mean_dot) + add);
      }
      store_chunk<T, V>(static_cast<T*>(p.y) + offset, v, xs[k]);
    }
  }
}

template <typename T>
bool vectors_fit(const RmsNormParams& p, bool backward) {
  // nullptr is aligned: the residual, its sum and grad_add count only where they are given
  return p.hidden % kVec<T> == 0 && aligned16(p.x) && aligned16(p.weight) && aligned16(p.y) &&
         aligned16(p.residual) && aligned16(p.sum) && aligned16(p.grad_add) && (!backward || aligned16(p.grad_y));
}

unsigned forward_blocks(int64_t rows, int group) {
  const int64_t rows_per_block = kThreads / group;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20));  // the kernel loops past this
}

using BackwardKernel = void (*)(RmsNormParams, int);

struct BackwardLaunch {
  BackwardKernel kernel;
  size_t shared;  // bytes of dynamic shared memory
};

// The kernel for rows of `vectors_per_lane` vectors per lane (see the top of this file).
template <typename T, int V, bool kAdd>
BackwardLaunch backward_launch(int64_t vectors_per_lane, int64_t hidden, bool weight_grad) {
  if (!weight_grad) {
    if constexpr (V > 1) {
      if (vectors_per_lane <= 1) return {rms_norm_backward_cached_kernel<T, V, 1, kAdd>, 0};
      if (vectors_per_lane <= 2) return {rms_norm_backward_cached_kernel<T, V, 2, kAdd>, 0};
      if (vectors_per_lane <= 4) return {rms_norm_backward_cached_kernel<T, V, 4, kAdd>, 0};
      if (vectors_per_lane <= 8) return {rms_norm_backward_cached_kernel<T, V, 8, kAdd>, 0};
      if (vectors_per_lane <= kMaxCachedBackwardVectors)
        return {rms_norm_backward_cached_kernel<T, V, kMaxCachedBackwardVectors, kAdd>, 0};
    }
    return {rms_norm_backward_kernel<T, V, false, kAdd>, 0};
  }
  const size_t row = static_cast<size_t>(hidden) * sizeof(float);
  if (vectors_per_lane <= 1) return {rms_norm_backward_registers_kernel<T, V, 1, kAdd>, row};
  if (vectors_per_lane <= kMaxRegisterVectors) return {rms_norm_backward_registers_kernel<T, V, 2, kAdd>, row};
  if (vectors_per_lane <= 4) return {rms_norm_backward_warp_sums_kernel<T, V, 4, kAdd>, kWarps * row};
  if (vectors_per_lane <= kMaxWarpSumVectors) return {rms_norm_backward_warp_sums_kernel<T, V, 8, kAdd>, kWarps * row};
  return {rms_norm_backward_kernel<T, V, true, kAdd>, row};
}

template <typename T, int V, bool kAdd>
cudaError_t launch_backward(const RmsNormParams& p, int blocks, cudaStream_t stream) {
  const int64_t vectors = p.hidden / V;
  const int group = lanes_per_row(vectors);
  const BackwardLaunch launch =
      backward_launch<T, V, kAdd>((vectors + group - 1) / group, p.hidden, p.grad_weight_partial != nullptr);
  if (launch.shared > 48 * 1024) {  // above the default: ask for more (fails past the device's limit)
    const cudaError_t err = cudaFuncSetAttribute(launch.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(launch.shared));
    if (err != cudaSuccess) return err;
  }
  launch.kernel<<<blocks, kThreads, launch.shared, stream>>>(p, group);
  return cudaGetLastError();
}

template <typename T, bool kAdd>
cudaError_t launch_forward(const RmsNormParams& p, cudaStream_t stream) {
  if (vectors_fit<T>(p, false)) {
    constexpr int V = kVec<T>;
    const int group = lanes_per_row(p.hidden / V);
    const int64_t per_lane = (p.hidden / V + group - 1) / group;
    const unsigned blocks = forward_blocks(p.rows, group);
    if (per_lane <= 1) {
      rms_norm_forward_cached_kernel<T, V, 1, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    } else if (per_lane <= 2) {
      rms_norm_forward_cached_kernel<T, V, 2, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    } else if (per_lane <= 4) {
      rms_norm_forward_cached_kernel<T, V, 4, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    } else if (per_lane <= 8) {
      rms_norm_forward_cached_kernel<T, V, 8, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    } else if (per_lane <= kMaxCachedVectors) {
      rms_norm_forward_cached_kernel<T, V, kMaxCachedVectors, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    } else {
      rms_norm_forward_kernel<T, V, kAdd><<<blocks, kThreads, 0, stream>>>(p, group);
    }
  } else {
    const int group = lanes_per_row(p.hidden);
    rms_norm_forward_kernel<T, 1, kAdd><<<forward_blocks(p.rows, group), kThreads, 0, stream>>>(p, group);
  }
  return cudaGetLastError();
}

}  // namespace

int rms_norm_backward_blocks(int64_t rows, int device) {
  int sms = 132;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t wanted = static_cast<int64_t>(sms) * 4;
  return static_cast<int>(rows < wanted ? (rows > 0 ? rows : 1) : wanted);
}

cudaError_t launch_rms_norm_forward(const RmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.hidden == 0) return cudaSuccess;
  if ((p.residual == nullptr) != (p.sum == nullptr)) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    return p.residual != nullptr ? launch_forward<T, true>(p, stream) : launch_forward<T, false>(p, stream);
  });
}

cudaError_t launch_rms_norm_backward(const RmsNormParams& p, int blocks, cudaStream_t stream) {
  if (p.hidden == 0) return cudaSuccess;  // no rows still launches: the blocks write zero partials
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const bool vectors = vectors_fit<T>(p, true);
    if (p.grad_add != nullptr)
      return vectors ? launch_backward<T, kVec<T>, true>(p, blocks, stream) : launch_backward<T, 1, true>(p, blocks, stream);
    return vectors ? launch_backward<T, kVec<T>, false>(p, blocks, stream) : launch_backward<T, 1, false>(p, blocks, stream);
  });
}

}  // namespace kernels
}  // namespace hasten
