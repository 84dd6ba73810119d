// MoE row movement: permute (tokens -> expert-sorted slots), combine (sorted slots ->
// tokens, weighted sum over the top-k choices in a fixed order: deterministic, no
// atomics), and the router-weight gradient of combine. Rows move as 16-byte vectors
// when the row length allows it.
#include "dtype_utils.cuh"
#include "moe.cuh"

namespace hasten {
namespace kernels {
namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// One token per block (as the combine): its row is read once, then written to each of its top_k
// positions (a scaled copy where slot_scale is given; zeros for a dropped slot). The gather form
// (one block per output row, reading x[permutation[p] / k]) read each token's row top_k times,
// far apart in time, and x (16,384 x 2,048 bf16, 64 MiB on W3) does not stay in L2: it moved
// 2 S rows (S reads, S writes) where this moves T + S. On an H100 at 7652501 the gather took
// 0.35 ms a call on W3's Qwen3 block (top-8) against the combine's 0.20, which moves S + T.
// Every position is written exactly once: inverse is a bijection of the S slots onto [0, S).
template <typename T, int V>
__global__ void moe_permute_kernel(const T* __restrict__ x, const int32_t* __restrict__ inverse,
                                   const int32_t* __restrict__ offsets, const T* __restrict__ slot_scale,
                                   T* __restrict__ out, int64_t hidden, int num_experts, int top_k) {
  const int64_t token = blockIdx.x;
  const int64_t num_slots = static_cast<int64_t>(gridDim.x) * top_k;
  const int64_t valid_slots = offsets[num_experts];
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < hidden; c += static_cast<int64_t>(blockDim.x) * V) {
    const Vec<T, V> row = *reinterpret_cast<const Vec<T, V>*>(x + token * hidden + c);
    for (int j = 0; j < top_k; ++j) {
      const int64_t slot = token * top_k + j;
      const int64_t pos = inverse[slot];
      if (pos < 0 || pos >= num_slots) continue;  // not a position: nothing to write
      Vec<T, V> chunk;
      if (pos >= valid_slots) {  // dropped slot: a zero row
#pragma unroll
        for (int i = 0; i < V; ++i) chunk.v[i] = from_float<T>(0.0f);
      } else if (slot_scale != nullptr) {
        const float scale = to_float(slot_scale[slot]);
#pragma unroll
        for (int i = 0; i < V; ++i) chunk.v[i] = from_float<T>(to_float(row.v[i]) * scale);
      } else {
        chunk = row;
      }
      *reinterpret_cast<Vec<T, V>*>(out + pos * hidden + c) = chunk;
    }
  }
}

template <typename T, int V>
__global__ void moe_combine_kernel(const T* __restrict__ y, const int32_t* __restrict__ inverse,
                                   const int32_t* __restrict__ offsets, const T* __restrict__ weights,
                                   T* __restrict__ out, int64_t hidden, int num_experts, int top_k) {
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
      const Vec<T, V> chunk = *reinterpret_cast<const Vec<T, V>*>(y + static_cast<int64_t>(pos) * hidden + c);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] += w * to_float(chunk.v[i]);
    }
    Vec<T, V> result;
#pragma unroll
    for (int i = 0; i < V; ++i) result.v[i] = from_float<T>(acc[i]);
    *reinterpret_cast<Vec<T, V>*>(out + token * hidden + c) = result;
  }
}

// One warp per (token, choice): a dot product of two rows.
template <typename T, int V>
__global__ void moe_combine_weight_grad_kernel(const T* __restrict__ grad_out, const T* __restrict__ y,
                                               const int32_t* __restrict__ inverse,
                                               const int32_t* __restrict__ offsets, T* __restrict__ grad_weights,
                                               int64_t num_slots, int64_t hidden, int num_experts, int top_k) {
  const int64_t slot = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (slot >= num_slots) return;
  const int pos = inverse[slot];
  float acc = 0.0f;
  if (pos < offsets[num_experts]) {
    const T* g = grad_out + (slot / top_k) * hidden;
    const T* r = y + static_cast<int64_t>(pos) * hidden;
    for (int64_t c = static_cast<int64_t>(lane) * V; c < hidden; c += 32 * V) {
      const Vec<T, V> a = *reinterpret_cast<const Vec<T, V>*>(g + c);
      const Vec<T, V> b = *reinterpret_cast<const Vec<T, V>*>(r + c);
#pragma unroll
      for (int i = 0; i < V; ++i) acc += to_float(a.v[i]) * to_float(b.v[i]);
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
  if (p.num_tokens == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* x = static_cast<const T*>(p.x);
    const T* scale = static_cast<const T*>(p.slot_scale);
    T* out = static_cast<T*>(p.out);
    if (rows_vectorizable<T>(p.hidden, x, out)) {
      moe_permute_kernel<T, kVec<T>><<<p.num_tokens, threads_for(p.hidden, kVec<T>), 0, stream>>>(
          x, p.inverse, p.offsets, scale, out, p.hidden, p.num_experts, p.top_k);
    } else {
      moe_permute_kernel<T, 1><<<p.num_tokens, threads_for(p.hidden, 1), 0, stream>>>(
          x, p.inverse, p.offsets, scale, out, p.hidden, p.num_experts, p.top_k);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const T* y = static_cast<const T*>(p.y);
    const T* w = static_cast<const T*>(p.weights);
    T* out = static_cast<T*>(p.out);
    if (rows_vectorizable<T>(p.hidden, y, out)) {
      moe_combine_kernel<T, kVec<T>><<<p.num_tokens, threads_for(p.hidden, kVec<T>), 0, stream>>>(
          y, p.inverse, p.offsets, w, out, p.hidden, p.num_experts, p.top_k);
    } else {
      moe_combine_kernel<T, 1><<<p.num_tokens, threads_for(p.hidden, 1), 0, stream>>>(
          y, p.inverse, p.offsets, w, out, p.hidden, p.num_experts, p.top_k);
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
    T* gw = static_cast<T*>(p.grad_weights);
    if (rows_vectorizable<T>(p.hidden, g, y)) {
      moe_combine_weight_grad_kernel<T, kVec<T>><<<blocks, kThreads, 0, stream>>>(
          g, y, p.inverse, p.offsets, gw, slots, p.hidden, p.num_experts, p.top_k);
    } else {
      moe_combine_weight_grad_kernel<T, 1><<<blocks, kThreads, 0, stream>>>(
          g, y, p.inverse, p.offsets, gw, slots, p.hidden, p.num_experts, p.top_k);
    }
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
