// SwiGLU, forward and backward, over rows of gate and up at a common row stride (swiglu.cuh):
// one pass reads both and writes the activation, or reads them with the incoming gradient and
// writes both gradients. float math.
#include "dtype_utils.cuh"
#include "swiglu.cuh"

namespace hasten {
namespace kernels {
namespace {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

template <typename T>
__global__ void swiglu_forward_kernel(SwigluParams p) {
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* act = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.inner;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.inner, c = i - r * p.inner;
    const float g = to_float(gate[r * p.in_stride + c]);
    const float u = to_float(up[r * p.in_stride + c]);
    act[i] = from_float<T>(g * sigmoid(g) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(SwigluParams p) {
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  const T* grad_act = static_cast<const T*>(p.grad_act);
  T* grad_gate = static_cast<T*>(p.out);
  T* grad_up = static_cast<T*>(p.out_up);
  const int64_t n = p.rows * p.inner;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.inner, c = i - r * p.inner;
    const float g = to_float(gate[r * p.in_stride + c]);
    const float u = to_float(up[r * p.in_stride + c]);
    const float d = to_float(grad_act[i]);
    const float sg = sigmoid(g);
    grad_gate[r * p.out_stride + c] = from_float<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
    grad_up[r * p.out_stride + c] = from_float<T>(d * g * sg);
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
    swiglu_forward_kernel<T><<<grid_for(p.rows * p.inner), 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_backward(const SwigluParams& p, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    swiglu_backward_kernel<T><<<grid_for(p.rows * p.inner), 256, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
