// SwiGLU, forward and backward, over rows of gate and up at a common row stride (swiglu.cuh):
// one pass reads both and writes the activation, or reads them with the incoming gradient and
// writes both gradients. float math. Rows sit on blockIdx.y (looping past the grid's limit) and
// columns on x in 16-byte chunks where every row is aligned for them (one element otherwise), so
// no thread divides an index.
#include "dtype_utils.cuh"
#include "swiglu.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(SwigluParams p) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk in the row
  if (v * V >= p.inner) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    T g[V], u[V];
    load_chunk<T, V>(static_cast<const T*>(p.gate) + r * p.in_stride, v, g);
    load_chunk<T, V>(static_cast<const T*>(p.up) + r * p.in_stride, v, u);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float gf = to_float(g[i]);
      g[i] = from_float<T>(gf * sigmoid(gf) * to_float(u[i]));
    }
    store_chunk<T, V>(static_cast<T*>(p.out) + r * p.inner, v, g);
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(SwigluParams p) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v * V >= p.inner) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    T g[V], u[V], d[V];
    load_chunk<T, V>(static_cast<const T*>(p.gate) + r * p.in_stride, v, g);
    load_chunk<T, V>(static_cast<const T*>(p.up) + r * p.in_stride, v, u);
    load_chunk<T, V>(static_cast<const T*>(p.grad_act) + r * p.inner, v, d);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float gf = to_float(g[i]), uf = to_float(u[i]), df = to_float(d[i]);
      const float sg = sigmoid(gf);
      g[i] = from_float<T>(df * uf * sg * (1.0f + gf * (1.0f - sg)));
      u[i] = from_float<T>(df * gf * sg);
    }
    store_chunk<T, V>(static_cast<T*>(p.out) + r * p.out_stride, v, g);
    store_chunk<T, V>(static_cast<T*>(p.out_up) + r * p.out_stride, v, u);
  }
}

// 16-byte chunks when every row of every tensor starts on a 16-byte boundary.
template <typename T>
bool vectors_fit(const SwigluParams& p, bool backward) {
  constexpr int kV = kVec<T>;
  const bool strides = p.inner % kV == 0 && p.in_stride % kV == 0 && (!backward || p.out_stride % kV == 0);
  const bool bases = aligned16(p.gate) && aligned16(p.up) && aligned16(p.out) &&
                     (!backward || (aligned16(p.grad_act) && aligned16(p.out_up)));
  return strides && bases;
}

dim3 grid_for(const SwigluParams& p, int elements_per_chunk) {
  const int64_t chunks = (p.inner + elements_per_chunk - 1) / elements_per_chunk;
  const int64_t rows = p.rows < 65535 ? p.rows : 65535;
  return dim3(static_cast<unsigned>((chunks + kThreads - 1) / kThreads), static_cast<unsigned>(rows));
}

}  // namespace

cudaError_t launch_swiglu_forward(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    if (vectors_fit<T>(p, false)) {
      swiglu_forward_kernel<T, kVec<T>><<<grid_for(p, kVec<T>), kThreads, 0, stream>>>(p);
    } else {
      swiglu_forward_kernel<T, 1><<<grid_for(p, 1), kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_backward(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    if (vectors_fit<T>(p, true)) {
      swiglu_backward_kernel<T, kVec<T>><<<grid_for(p, kVec<T>), kThreads, 0, stream>>>(p);
    } else {
      swiglu_backward_kernel<T, 1><<<grid_for(p, 1), kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
