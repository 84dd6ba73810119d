// RMSNorm forward and backward, one thread block per row (rms_norm.cuh).
#include "dtype_utils.cuh"
#include "rms_norm.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;

__device__ float block_sum(float value) {
  __shared__ float partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // partial may still be read from the previous call
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  value = lane < kThreads / 32 ? partial[lane] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;  // every thread of the block holds the sum
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_forward_kernel(RmsNormParams p) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.hidden;
  const T* w = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y) + row * p.hidden;
  float squares = 0.f;
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) {
    const float v = to_float(x[c]);
    squares += v * v;
  }
  const float rstd = rsqrtf(block_sum(squares) / static_cast<float>(p.hidden) + p.eps);
  if (threadIdx.x == 0) p.rstd[row] = rstd;
  for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) {
    const float normalised = to_float(from_float<T>(to_float(x[c]) * rstd));
    y[c] = from_float<T>((to_float(w[c]) + p.offset) * normalised);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_backward_kernel(RmsNormParams p) {
  const T* w = static_cast<const T*>(p.weight);
  float* partial = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.hidden;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(p.x) + row * p.hidden;
    const T* g = static_cast<const T*>(p.grad_y) + row * p.hidden;
    T* gx = static_cast<T*>(p.y) + row * p.hidden;
    const float rstd = p.rstd[row];
    float dot = 0.f;
    for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) {
      const float n = to_float(x[c]) * rstd;
      dot += (to_float(w[c]) + p.offset) * to_float(g[c]) * n;
    }
    const float mean_dot = block_sum(dot) / static_cast<float>(p.hidden);
    for (int64_t c = threadIdx.x; c < p.hidden; c += kThreads) {
      const float n = to_float(x[c]) * rstd;
      const float gy = to_float(g[c]);
      gx[c] = from_float<T>(rstd * ((to_float(w[c]) + p.offset) * gy - n * mean_dot));
      partial[c] += gy * to_float(from_float<T>(n));  // this thread alone owns column c of this block
    }
  }
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
  if (p.rows > 0x7fffffff) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    rms_norm_forward_kernel<T><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

cudaError_t launch_rms_norm_backward(const RmsNormParams& p, int blocks, cudaStream_t stream) {
  if (p.rows == 0 || p.hidden == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    rms_norm_backward_kernel<T><<<blocks, kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
