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

// kPermuteRows output rows per block; each thread moves V elements of every row at a time. One row
// per block (2,048 bf16: one 16-byte vector per thread) left each block a chain of three dependent
// loads (offsets, permutation, source row) for 4 KiB: latency-bound at about 1.9 TB/s of writes on
// W3 (0.28 ms for 131,072 rows, where the combine moves as many bytes in 0.15). Four rows per block
// put four independent source loads in flight per thread.
// The scatter form (one block per token: read its row once, write its k positions; 91ac38f) was
// measured 3x slower on an H100 (W3 Qwen3: 1.17 and 0.96 ms a call against 0.35), though it
// moves T + S rows where this moves 2 S: random 4 KiB row writes ran near 0.5 TB/s, where the
// combine's random 4 KiB row reads run near bandwidth. The gather's writes stay sequential.
constexpr int kPermuteRows = 4;

template <typename T, int V>
__global__ void moe_permute_kernel(const T* __restrict__ x, const int32_t* __restrict__ permutation,
                                   const int32_t* __restrict__ offsets, const T* __restrict__ slot_scale,
                                   T* __restrict__ out, int64_t num_slots, int64_t hidden, int num_experts,
                                   int top_k) {
  const int64_t valid_slots = offsets[num_experts];
  const T* src[kPermuteRows];
  T* dst[kPermuteRows];
  float scale[kPermuteRows];
  bool live[kPermuteRows], valid[kPermuteRows];
#pragma unroll
  for (int r = 0; r < kPermuteRows; ++r) {
    const int64_t pos = static_cast<int64_t>(blockIdx.x) * kPermuteRows + r;
    live[r] = pos < num_slots;
    valid[r] = live[r] && pos < valid_slots;
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

cudaError_t launch_moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  if (p.num_slots == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* x = static_cast<const T*>(p.x);
    const T* scale = static_cast<const T*>(p.slot_scale);
    T* out = static_cast<T*>(p.out);
    const int64_t blocks = (p.num_slots + kPermuteRows - 1) / kPermuteRows;
    if (rows_vectorizable<T>(p.hidden, x, out)) {
      moe_permute_kernel<T, kVec<T>><<<blocks, threads_for(p.hidden, kVec<T>), 0, stream>>>(
          x, p.permutation, p.offsets, scale, out, p.num_slots, p.hidden, p.num_experts, p.top_k);
    } else {
      moe_permute_kernel<T, 1><<<blocks, threads_for(p.hidden, 1), 0, stream>>>(
          x, p.permutation, p.offsets, scale, out, p.num_slots, p.hidden, p.num_experts, p.top_k);
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
