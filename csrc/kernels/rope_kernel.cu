// Rotary embedding on q or k, forward or backward (rope.cuh). blockIdx.y walks the (batch, head)
// pairs (looping past the grid's limit), x the (position, chunk) items of one head: a chunk is V
// consecutive pairs (j, j + D/2), read as 16-byte vectors from both halves where the strides and
// pointers allow it, else one pair (V = 1). Index arithmetic happens once per chunk, not per element.
#include "dtype_utils.cuh"
#include "rope.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;

template <typename T, typename C, int V>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t half = p.dim / 2;
  const int64_t chunks_per_row = half / V;
  const int64_t items = p.length * chunks_per_row;
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  for (int64_t bh = blockIdx.y; bh < p.batch * p.heads; bh += gridDim.y) {
    const int64_t b = bh / p.heads, h = bh - b * p.heads;
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + h * p.x_stride[1];
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1];
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t l = item / chunks_per_row, chunk = item - l * chunks_per_row;
      const T* xl = x + l * p.x_stride[2];
      T* ol = out + l * p.out_stride[2];
      const C* cl = cos + b * p.cs_stride[0] + l * p.cs_stride[1];
      const C* sl = sin + b * p.cs_stride[0] + l * p.cs_stride[1];
      T lo[V], hi[V];
      load_chunk<T, V>(xl, chunk, lo);
      load_chunk<T, V>(xl + half, chunk, hi);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int64_t j = chunk * V + i;
        const float a = to_float(lo[i]), c = to_float(hi[i]);
        const float c_lo = to_float(cl[j]), c_hi = to_float(cl[j + half]);
        const float s_lo = to_float(sl[j]), s_hi = to_float(sl[j + half]);
        if (!p.backward) {
          lo[i] = from_float<T>(a * c_lo - c * s_lo);
          hi[i] = from_float<T>(c * c_hi + a * s_hi);
        } else {
          lo[i] = from_float<T>(a * c_lo + c * s_hi);
          hi[i] = from_float<T>(c * c_hi - a * s_lo);
        }
      }
      store_chunk<T, V>(ol, chunk, lo);
      store_chunk<T, V>(ol + half, chunk, hi);
    }
  }
}

// 16-byte chunks when both halves of every row of x and out start on a 16-byte boundary.
template <typename T>
bool vectors_fit(const RopeParams& p) {
  constexpr int kV = kVec<T>;
  const int64_t half = p.dim / 2;
  bool strides = half % kV == 0;
  for (int i = 0; i < 3; ++i) strides = strides && p.x_stride[i] % kV == 0 && p.out_stride[i] % kV == 0;
  return strides && aligned16(p.x) && aligned16(p.out);
}

template <typename T, int V>
cudaError_t launch_for(const RopeParams& p, cudaStream_t stream) {
  const int64_t items = p.length * (p.dim / 2 / V);
  int64_t blocks_x = (items + kThreads - 1) / kThreads;
  blocks_x = blocks_x < 65535 ? blocks_x : 65535;
  const int64_t heads = p.batch * p.heads;
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(heads < 65535 ? heads : 65535));
  switch (p.cs_type) {
    case ElementType::kFloat32: rope_kernel<T, float, V><<<grid, kThreads, 0, stream>>>(p); break;
    case ElementType::kFloat16: rope_kernel<T, __half, V><<<grid, kThreads, 0, stream>>>(p); break;
    case ElementType::kBFloat16: rope_kernel<T, __nv_bfloat16, V><<<grid, kThreads, 0, stream>>>(p); break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  if (p.batch * p.heads * p.length * (p.dim / 2) == 0) return cudaSuccess;
  if (p.dim % 2 != 0) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    return vectors_fit<T>(p) ? launch_for<T, kVec<T>>(p, stream) : launch_for<T, 1>(p, stream);
  });
}

}  // namespace kernels
}  // namespace hasten
