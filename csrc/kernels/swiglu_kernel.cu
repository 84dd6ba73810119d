// SwiGLU on the concatenated [gate | up] rows of the experts' first projection:
// one pass reads both halves and writes the activation (forward), or reads them with
// the incoming gradient and writes both halves' gradients (backward). float math.
#include "dtype_utils.cuh"
#include "moe.cuh"

namespace hasten {
namespace kernels {
namespace {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate_up, T* __restrict__ act, int64_t rows,
                                      int64_t inner) {
  const int64_t n = rows * inner;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inner, c = i - r * inner;
    const float g = to_float(gate_up[r * 2 * inner + c]);
    const float u = to_float(gate_up[r * 2 * inner + inner + c]);
    act[i] = from_float<T>(g * sigmoid(g) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ gate_up, const T* __restrict__ grad_act,
                                       T* __restrict__ grad_gate_up, int64_t rows, int64_t inner) {
  const int64_t n = rows * inner;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inner, c = i - r * inner;
    const float g = to_float(gate_up[r * 2 * inner + c]);
    const float u = to_float(gate_up[r * 2 * inner + inner + c]);
    const float d = to_float(grad_act[i]);
    const float sg = sigmoid(g);
    grad_gate_up[r * 2 * inner + c] = from_float<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
    grad_gate_up[r * 2 * inner + inner + c] = from_float<T>(d * g * sg);
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

}  // namespace

cudaError_t launch_swiglu_forward(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    swiglu_forward_kernel<T><<<grid_for(p.rows * p.inner), 256, 0, stream>>>(
        static_cast<const T*>(p.gate_up), static_cast<T*>(p.out), p.rows, p.inner);
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_backward(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    swiglu_backward_kernel<T><<<grid_for(p.rows * p.inner), 256, 0, stream>>>(
        static_cast<const T*>(p.gate_up), static_cast<const T*>(p.grad_act), static_cast<T*>(p.out), p.rows,
        p.inner);
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
