// RMSNorm forward and backward (rms_norm.cuh). A row belongs to a group of `group` lanes of one
// warp (a power of two up to 32, sized to the row: 16 lanes for a 128-wide head norm, a full
// warp for hidden 1024 and up), so a 256-thread block works on 256 / group rows at once and the
// row's sum needs only warp shuffles, no __syncthreads. Rows move as 16-byte vectors when the
// hidden size and the pointers allow it, else one element at a time (the same kernel, V = 1).
// The backward sums grad_y * n for the weight in shared memory per block (float atomics there),
// then writes one partial row per block for the caller to sum: no global atomics, and the order
// of additions inside a block does not change the result beyond float rounding.
#include "dtype_utils.cuh"
#include "rms_norm.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// Sum over the `group` lanes that share a row; every lane of the group gets it. All 32 lanes of
// the warp must call it (xor offsets below `group` stay inside the group).
__device__ __forceinline__ float group_sum(float value, int group) {
  for (int offset = group / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;
}

struct RowSlot {
  int64_t first, step;  // first row of this group, rows between its turns
  int lane;             // lane inside the group
};

__device__ __forceinline__ RowSlot row_slot(int group) {
  const int groups_per_block = kThreads / group;
  return {static_cast<int64_t>(blockIdx.x) * groups_per_block + threadIdx.x / group,
          static_cast<int64_t>(gridDim.x) * groups_per_block, static_cast<int>(threadIdx.x % group)};
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) rms_norm_forward_kernel(RmsNormParams p, int group) {
  const RowSlot slot = row_slot(group);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  // row0 (the first row of this warp's groups) is the same on every lane of the warp, so all 32
  // lanes take the same trips through the loop and reach the shuffles together.
  for (int64_t row0 = slot.first - threadIdx.x % 32 / group; row0 < p.rows; row0 += slot.step) {
    const int64_t row = row0 + threadIdx.x % 32 / group;
    const bool active = row < p.rows;
    const T* x = static_cast<const T*>(p.x) + (active ? row : 0) * p.hidden;
    float squares = 0.f;
    if (active) {
      for (int64_t v = slot.lane; v < vectors; v += group) {
        T chunk[V];
        load_chunk<T, V>(x, v, chunk);
#pragma unroll
        for (int i = 0; i < V; ++i) squares += to_float(chunk[i]) * to_float(chunk[i]);
      }
    }
    const float rstd = rsqrtf(group_sum(squares, group) / static_cast<float>(p.hidden) + p.eps);
    if (!active) continue;
    if (slot.lane == 0) p.rstd[row] = rstd;
    T* y = static_cast<T*>(p.y) + row * p.hidden;
    for (int64_t v = slot.lane; v < vectors; v += group) {
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

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) rms_norm_backward_kernel(RmsNormParams p, int group) {
  extern __shared__ float block_grad_weight[];  // (hidden,) this block's share of grad_weight
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) block_grad_weight[c] = 0.f;
  __syncthreads();
  const RowSlot slot = row_slot(group);
  const int64_t vectors = p.hidden / V;
  const T* w = static_cast<const T*>(p.weight);
  for (int64_t row0 = slot.first - threadIdx.x % 32 / group; row0 < p.rows; row0 += slot.step) {
    const int64_t row = row0 + threadIdx.x % 32 / group;
    const bool active = row < p.rows;
    const int64_t offset = (active ? row : 0) * p.hidden;
    const T* x = static_cast<const T*>(p.x) + offset;
    const T* g = static_cast<const T*>(p.grad_y) + offset;
    const float rstd = active ? p.rstd[row] : 0.f;
    float dot = 0.f;
    if (active) {
      for (int64_t v = slot.lane; v < vectors; v += group) {
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
    for (int64_t v = slot.lane; v < vectors; v += group) {
      T xs[V], gs[V], ws[V];
      load_chunk<T, V>(x, v, xs);
      load_chunk<T, V>(g, v, gs);
      load_chunk<T, V>(w, v, ws);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[i]) * rstd;
        const float gy = to_float(gs[i]);
        atomicAdd(&block_grad_weight[v * V + i], gy * to_float(from_float<T>(n)));
        xs[i] = from_float<T>(rstd * ((to_float(ws[i]) + p.offset) * gy - n * mean_dot));
      }
      store_chunk<T, V>(gx, v, xs);
    }
  }
  __syncthreads();
  float* partial = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.hidden;
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) partial[c] = block_grad_weight[c];
}

// Lanes per row: enough for one vector each, a power of two, at most a warp.
int lanes_per_row(int64_t vectors) {
  int group = 1;
  while (group < 32 && group < vectors) group *= 2;
  return group;
}

template <typename T>
bool vectors_fit(const RmsNormParams& p, bool backward) {
  return p.hidden % kVec<T> == 0 && aligned16(p.x) && aligned16(p.weight) && aligned16(p.y) &&
         (!backward || aligned16(p.grad_y));
}

unsigned forward_blocks(int64_t rows, int group) {
  const int64_t rows_per_block = kThreads / group;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20));  // the kernel loops past this
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
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    if (vectors_fit<T>(p, false)) {
      const int group = lanes_per_row(p.hidden / kVec<T>);
      rms_norm_forward_kernel<T, kVec<T>><<<forward_blocks(p.rows, group), kThreads, 0, stream>>>(p, group);
    } else {
      const int group = lanes_per_row(p.hidden);
      rms_norm_forward_kernel<T, 1><<<forward_blocks(p.rows, group), kThreads, 0, stream>>>(p, group);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_rms_norm_backward(const RmsNormParams& p, int blocks, cudaStream_t stream) {
  if (p.hidden == 0) return cudaSuccess;  // no rows still launches: the blocks write zero partials
  const size_t shared = static_cast<size_t>(p.hidden) * sizeof(float);
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    const bool vec = vectors_fit<T>(p, true);
    auto kernel = vec ? rms_norm_backward_kernel<T, kVec<T>> : rms_norm_backward_kernel<T, 1>;
    const int group = lanes_per_row(vec ? p.hidden / kVec<T> : p.hidden);
    if (shared > 48 * 1024) {  // above the default: ask for more (fails past the device's limit)
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
      if (err != cudaSuccess) return err;
    }
    kernel<<<blocks, kThreads, shared, stream>>>(p, group);
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
