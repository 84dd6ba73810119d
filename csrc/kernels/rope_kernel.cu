// Rotary embedding on q or k, forward or backward (rope.cuh): one thread per (j, j + D/2) pair.
#include "dtype_utils.cuh"
#include "rope.cuh"

namespace hasten {
namespace kernels {
namespace {

template <typename T, typename C>
__global__ void rope_kernel(RopeParams p) {
  const int64_t half = p.dim / 2;
  const int64_t pairs = p.batch * p.heads * p.length * half;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % half;
    int64_t rest = i / half;
    const int64_t l = rest % p.length;
    rest /= p.length;
    const int64_t h = rest % p.heads;
    const int64_t b = rest / p.heads;
    const int64_t xo = b * p.x_stride[0] + h * p.x_stride[1] + l * p.x_stride[2];
    const int64_t oo = b * p.out_stride[0] + h * p.out_stride[1] + l * p.out_stride[2];
    const int64_t co = b * p.cs_stride[0] + l * p.cs_stride[1];
    const float lo = to_float(x[xo + j]), hi = to_float(x[xo + j + half]);
    const float c_lo = to_float(cos[co + j]), c_hi = to_float(cos[co + j + half]);
    const float s_lo = to_float(sin[co + j]), s_hi = to_float(sin[co + j + half]);
    if (!p.backward) {
      out[oo + j] = from_float<T>(lo * c_lo - hi * s_lo);
      out[oo + j + half] = from_float<T>(hi * c_hi + lo * s_hi);
    } else {
      out[oo + j] = from_float<T>(lo * c_lo + hi * s_hi);
      out[oo + j + half] = from_float<T>(hi * c_hi - lo * s_lo);
    }
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8);
}

template <typename T>
cudaError_t launch_for(const RopeParams& p, int64_t pairs, cudaStream_t stream) {
  switch (p.cs_type) {
    case ElementType::kFloat32: rope_kernel<T, float><<<grid_for(pairs), 256, 0, stream>>>(p); break;
    case ElementType::kFloat16: rope_kernel<T, __half><<<grid_for(pairs), 256, 0, stream>>>(p); break;
    case ElementType::kBFloat16: rope_kernel<T, __nv_bfloat16><<<grid_for(pairs), 256, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  const int64_t pairs = p.batch * p.heads * p.length * (p.dim / 2);
  if (pairs == 0) return cudaSuccess;
  if (p.dim % 2 != 0) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, { return launch_for<T>(p, pairs, stream); });
}

}  // namespace kernels
}  // namespace hasten
