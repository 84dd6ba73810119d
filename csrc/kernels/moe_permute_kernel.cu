// MoE row movement: permute (tokens -> expert-sorted slots), combine (sorted slots ->
// tokens, weighted sum over the top-k choices in a fixed order: deterministic, no
// atomics), and the router-weight gradient of combine. Rows move as 16-byte vectors
// when the row length allows it.
#include "dtype_utils.cuh"
#include "expert_rows.cuh"
#include "moe.cuh"

namespace hasten {
namespace kernels {
namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// Rows per step of a block's loop: each thread moves V elements of kPermuteRows rows at a time, so
// four independent source loads are in flight per thread (one row at a time was latency-bound:
// a chain of dependent loads for 4 KiB of row).
constexpr int kPermuteRows = 4;
// Rows a block moves on average (moe_permute_parts): enough to amortise the block's start, few
// enough that the blocks in flight together span a small window of tokens (below).
constexpr int64_t kPermuteRowsPerBlock = 16;

// Which rows a block moves. Gathering in position order (block b: positions 4b..4b+3) reads each
// token's row k times, at k far-apart moments (its k experts' stretches of the sorted rows); x
// (T, H) is larger than L2 on W3 (64 MiB for Qwen3-30B-A3B), so the row comes from DRAM each time:
// about 2 S rows of traffic (0.33 ms a call on an H100). So block b moves part c = b / (E + 1) of
// bucket e = b % (E + 1) (the experts, then the dropped slots): positions offsets[e] +
// [n_e c / C, n_e (c + 1) / C) of the bucket's n_e rows, C = parts. Inside a bucket the grouping
// keeps slot order (stable), so part c of every bucket holds about the same tokens, the c-th C-th
// of the batch where the routing spreads over it, and the blocks in flight together (part-major
// order) read a window of x that stays in L2: about S + T rows of traffic. Every position lies in
// exactly one part whatever the permutation: the order decides only what L2 holds, never the output.
// Cut by rows, not at token bounds: exact bounds (two searches a block, 758ee8f) hand a few blocks
// most of the rows where an expert's tokens bunch up, and were slower under skewed routing.
template <typename T, int V>
__global__ void moe_permute_kernel(const T* __restrict__ x, const int32_t* __restrict__ permutation,
                                   const int32_t* __restrict__ offsets, const T* __restrict__ slot_scale,
                                   T* __restrict__ out, int64_t num_slots, int64_t hidden, int num_experts,
                                   int top_k, int64_t parts) {
  const int64_t buckets = static_cast<int64_t>(num_experts) + 1;
  const int64_t bucket = blockIdx.x % buckets, part = blockIdx.x / buckets;
  const int64_t valid_slots = offsets[num_experts];
  const int64_t first = offsets[bucket];
  const int64_t rows = (bucket < num_experts ? offsets[bucket + 1] : num_slots) - first;
  const int64_t begin = first + rows * part / parts, end = first + rows * (part + 1) / parts;
  for (int64_t base = begin; base < end; base += kPermuteRows) {
    const T* src[kPermuteRows];
    T* dst[kPermuteRows];
    float scale[kPermuteRows];
    bool live[kPermuteRows], valid[kPermuteRows];
#pragma unroll
    for (int r = 0; r < kPermuteRows; ++r) {
      const int64_t pos = base + r;
      live[r] = pos < end;
      valid[r] = live[r] && pos < valid_slots;  // rows of dropped slots are written as zeros
      const int64_t slot = valid[r] ? permutation[pos] : 0;
      scale[r] = (valid[r] && slot_scale != nullptr) ? to_float(slot_scale[slot]) : 1.0f;
      src[r] = x + (slot / top_k) * hidden;
      dst[r] = out + (live[r] ? pos : 0) * hidden;
    }
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < hidden; c += static_cast<int64_t>(blockDim.x) * V) {
      Vec<T, V> chunk[kPermuteRows];
#pragma unroll
      for (int r = 0; r < kPermuteRows; ++r) {
        if (valid[r]) {
          chunk[r] = *reinterpret_cast<const Vec<T, V>*>(src[r] + c);
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) chunk[r].v[i] = from_float<T>(0.0f);
        }
      }
#pragma unroll
      for (int r = 0; r < kPermuteRows; ++r) {
        if (!live[r]) continue;
        if (slot_scale != nullptr) {
#pragma unroll
          for (int i = 0; i < V; ++i) chunk[r].v[i] = from_float<T>(to_float(chunk[r].v[i]) * scale[r]);
        }
        *reinterpret_cast<Vec<T, V>*>(dst[r] + c) = chunk[r];
      }
    }
  }
}

// Row pos's expert bias (E, H) where kBias, else nullptr; offsets + 1 are the groups' inclusive ends.
template <typename T, bool kBias>
__device__ __forceinline__ const T* bias_row(const T* __restrict__ bias, const int32_t* __restrict__ offsets,
                                             int num_experts, int pos, int64_t hidden) {
  if constexpr (kBias) return bias + expert_of_row(offsets + 1, num_experts, pos) * hidden;
  return nullptr;
}

// Chunk c of a row of y as floats; with kBias plus chunk c of the row's expert bias (bias_row),
// rounded to T as the model's `y + bias` in its dtype is.
template <typename T, int V, bool kBias>
__device__ __forceinline__ void load_biased_row(const T* __restrict__ row, const T* __restrict__ bias, int64_t c,
                                                float (&out)[V]) {
  const Vec<T, V> chunk = *reinterpret_cast<const Vec<T, V>*>(row + c);
  if constexpr (kBias) {
    const Vec<T, V> b = *reinterpret_cast<const Vec<T, V>*>(bias + c);
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_float(from_float<T>(to_float(chunk.v[i]) + to_float(b.v[i])));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = to_float(chunk.v[i]);
  }
}

template <typename T, int V, bool kBias>
__global__ void moe_combine_kernel(const T* __restrict__ y, const int32_t* __restrict__ inverse,
                                   const int32_t* __restrict__ offsets, const T* __restrict__ weights,
                                   const T* __restrict__ bias, T* __restrict__ out, int64_t hidden, int num_experts,
                                   int top_k) {
  const int64_t token = blockIdx.x;
  const int valid_slots = offsets[num_experts];
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < hidden; c += static_cast<int64_t>(blockDim.x) * V) {
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const int64_t slot = token * top_k + j;
      const int pos = inverse[slot];
      if (pos >= valid_slots) continue;  // dropped slot
      const float w = weights != nullptr ? to_float(weights[slot]) : 1.0f;
      float row[V];
      load_biased_row<T, V, kBias>(y + static_cast<int64_t>(pos) * hidden,
                                   bias_row<T, kBias>(bias, offsets, num_experts, pos, hidden), c, row);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += w * row[i];
    }
    Vec<T, V> result;
#pragma unroll
    for (int i = 0; i < V; ++i) result.v[i] = from_float<T>(acc[i]);
    *reinterpret_cast<Vec<T, V>*>(out + token * hidden + c) = result;
  }
}

// One warp per (token, choice): a dot product of two rows.
template <typename T, int V, bool kBias>
__global__ void moe_combine_weight_grad_kernel(const T* __restrict__ grad_out, const T* __restrict__ y,
                                               const int32_t* __restrict__ inverse,
                                               const int32_t* __restrict__ offsets, const T* __restrict__ bias,
                                               T* __restrict__ grad_weights, int64_t num_slots, int64_t hidden,
                                               int num_experts, int top_k) {
  const int64_t slot = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (slot >= num_slots) return;
  const int pos = inverse[slot];
  float acc = 0.0f;
  if (pos < offsets[num_experts]) {
    const T* g = grad_out + (slot / top_k) * hidden;
    const T* r = y + static_cast<int64_t>(pos) * hidden;
    const T* b = bias_row<T, kBias>(bias, offsets, num_experts, pos, hidden);  // once per warp, not per chunk
    for (int64_t c = static_cast<int64_t>(lane) * V; c < hidden; c += 32 * V) {
      const Vec<T, V> a = *reinterpret_cast<const Vec<T, V>*>(g + c);
      float row[V];
      load_biased_row<T, V, kBias>(r, b, c, row);
#pragma unroll
      for (int i = 0; i < V; ++i) acc += to_float(a.v[i]) * row[i];
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
  if (lane == 0) grad_weights[slot] = from_float<T>(acc);
}

template <typename T>
bool rows_vectorizable(int64_t hidden, const void* a, const void* b) {
  return hidden % kVec<T> == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

int threads_for(int64_t hidden, int vec) {
  const int64_t needed = (hidden + vec - 1) / vec;
  int threads = 32;
  while (threads < needed && threads < 256) threads *= 2;
  return threads;
}

}  // namespace

int64_t moe_permute_parts(int64_t num_slots, int num_experts) {
  const int64_t per_part = (static_cast<int64_t>(num_experts) + 1) * kPermuteRowsPerBlock;
  const int64_t parts = (num_slots + per_part - 1) / per_part;
  return parts > 0 ? parts : 1;
}

cudaError_t launch_moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  if (p.num_slots == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* x = static_cast<const T*>(p.x);
    const T* scale = static_cast<const T*>(p.slot_scale);
    T* out = static_cast<T*>(p.out);
    const int64_t parts = moe_permute_parts(p.num_slots, p.num_experts);
    const int64_t blocks = parts * (p.num_experts + 1);
    if (rows_vectorizable<T>(p.hidden, x, out)) {
      moe_permute_kernel<T, kVec<T>><<<blocks, threads_for(p.hidden, kVec<T>), 0, stream>>>(
          x, p.permutation, p.offsets, scale, out, p.num_slots, p.hidden, p.num_experts, p.top_k, parts);
    } else {
      moe_permute_kernel<T, 1><<<blocks, threads_for(p.hidden, 1), 0, stream>>>(
          x, p.permutation, p.offsets, scale, out, p.num_slots, p.hidden, p.num_experts, p.top_k, parts);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* y = static_cast<const T*>(p.y);
    const T* w = static_cast<const T*>(p.weights);
    const T* bias = static_cast<const T*>(p.bias);
    T* out = static_cast<T*>(p.out);
    const bool vectors = rows_vectorizable<T>(p.hidden, y, out) && aligned16(bias);
    const int threads = threads_for(p.hidden, vectors ? kVec<T> : 1);
    auto launch = [&](auto kernel) {
      kernel<<<p.num_tokens, threads, 0, stream>>>(y, p.inverse, p.offsets, w, bias, out, p.hidden, p.num_experts,
                                                   p.top_k);
    };
    if (vectors) {
      if (bias != nullptr) launch(moe_combine_kernel<T, kVec<T>, true>);
      else launch(moe_combine_kernel<T, kVec<T>, false>);
    } else {
      if (bias != nullptr) launch(moe_combine_kernel<T, 1, true>);
      else launch(moe_combine_kernel<T, 1, false>);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_moe_combine_weight_grad(const MoeCombineWeightGradParams& p, cudaStream_t stream) {
  const int64_t slots = p.num_tokens * p.top_k;
  if (slots == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (slots * 32 + kThreads - 1) / kThreads;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* g = static_cast<const T*>(p.grad_out);
    const T* y = static_cast<const T*>(p.y);
    const T* bias = static_cast<const T*>(p.bias);
    T* gw = static_cast<T*>(p.grad_weights);
    auto launch = [&](auto kernel) {
      kernel<<<blocks, kThreads, 0, stream>>>(g, y, p.inverse, p.offsets, bias, gw, slots, p.hidden, p.num_experts,
                                              p.top_k);
    };
    if (rows_vectorizable<T>(p.hidden, g, y) && aligned16(bias)) {
      if (bias != nullptr) launch(moe_combine_weight_grad_kernel<T, kVec<T>, true>);
      else launch(moe_combine_weight_grad_kernel<T, kVec<T>, false>);
    } else {
      if (bias != nullptr) launch(moe_combine_weight_grad_kernel<T, 1, true>);
      else launch(moe_combine_weight_grad_kernel<T, 1, false>);
    }
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
