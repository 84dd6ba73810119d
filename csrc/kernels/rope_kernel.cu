// Rotary embedding on q or k, forward or backward, full or partial, rotate_half or interleaved
// pairs (rope.cuh). blockIdx.y walks the (batch, head) pairs (looping past the grid's limit), x the
// (position, item) work of one head. A position's row is split into items, in one launch:
//   rotation items      first R features; rotate_half: V pairs (j, j + R/2), V consecutive
//                       elements read from each half; interleaved: V consecutive elements holding
//                       V/2 pairs (2j, 2j + 1) (one pair, two scalar reads, when V = 1)
//   pass-through items  V consecutive features of R..D-1, copied (partial rotary)
// V = 16 bytes of elements where strides, R, D - R and pointers allow it, else V = 1. Index
// arithmetic happens once per item, not per element.
#include "dtype_utils.cuh"
#include "rope.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// Pairs one rotation item rotates, for vector width V.
template <int V, bool kInterleaved>
constexpr int kPairsPerItem = kInterleaved ? (V > 1 ? V / 2 : 1) : V;

// Items of one position's row: rotation items, then pass-through items (V divides D - R when V > 1).
template <int V, bool kInterleaved>
__host__ __device__ __forceinline__ int64_t rotation_items(const RopeParams& p) {
  return p.rotary_dim / 2 / kPairsPerItem<V, kInterleaved>;
}
template <int V>
__host__ __device__ __forceinline__ int64_t pass_through_items(const RopeParams& p) {
  return (p.dim - p.rotary_dim) / V;
}

// N consecutive elements starting at element k * N: one 16-byte access when they are 16 bytes,
// else N scalar accesses (the interleaved layout's one-pair fallback, N = 2).
template <typename T, int N>
__device__ __forceinline__ void load_elements(const T* row, int64_t k, T (&e)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    load_chunk<T, N>(row, k, e);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = row[k * N + i];
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_elements(T* row, int64_t k, const T (&e)[N]) {
  if constexpr (N * sizeof(T) == 16) {
    store_chunk<T, N>(row, k, e);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) row[k * N + i] = e[i];
  }
}

// One pair (x_lo, x_hi) in place, with cos and sin at feature indices lo and hi (rope.cuh).
template <typename T, typename C>
__device__ __forceinline__ void rotate_pair(T& x_lo, T& x_hi, const C* cos, const C* sin, int64_t lo, int64_t hi,
                                            bool backward) {
  const float a = to_float(x_lo), b = to_float(x_hi);
  const float c_lo = to_float(cos[lo]), c_hi = to_float(cos[hi]);
  const float s_lo = to_float(sin[lo]), s_hi = to_float(sin[hi]);
  if (!backward) {
    x_lo = from_float<T>(a * c_lo - b * s_lo);
    x_hi = from_float<T>(b * c_hi + a * s_hi);
  } else {
    x_lo = from_float<T>(a * c_lo + b * s_hi);
    x_hi = from_float<T>(b * c_hi - a * s_lo);
  }
}

template <typename T, typename C, int V, bool kInterleaved>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t rotate = rotation_items<V, kInterleaved>(p);
  const int64_t items_per_row = rotate + pass_through_items<V>(p);
  const int64_t items = p.length * items_per_row;
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  for (int64_t bh = blockIdx.y; bh < p.batch * p.heads; bh += gridDim.y) {
    const int64_t b = bh / p.heads, h = bh - b * p.heads;
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + h * p.x_stride[1];
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1];
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t l = item / items_per_row, k = item - l * items_per_row;
      const T* xl = x + l * p.x_stride[2];
      T* ol = out + l * p.out_stride[2];
      if (k >= rotate) {  // features R..D-1: unchanged, forward and backward
        T e[V];
        load_chunk<T, V>(xl + p.rotary_dim, k - rotate, e);
        store_chunk<T, V>(ol + p.rotary_dim, k - rotate, e);
        continue;
      }
      const C* cl = cos + b * p.cs_stride[0] + l * p.cs_stride[1];
      const C* sl = sin + b * p.cs_stride[0] + l * p.cs_stride[1];
      if constexpr (kInterleaved) {
        constexpr int kPairs = kPairsPerItem<V, true>;
        T e[2 * kPairs];  // features 2 kPairs k .. 2 kPairs (k + 1) - 1, pairs (e[2i], e[2i+1])
        load_elements<T, 2 * kPairs>(xl, k, e);
#pragma unroll
        for (int i = 0; i < kPairs; ++i) {
          const int64_t lo = 2 * (k * kPairs + i);
          rotate_pair<T, C>(e[2 * i], e[2 * i + 1], cl, sl, lo, lo + 1, p.backward);
        }
        store_elements<T, 2 * kPairs>(ol, k, e);
      } else {
        T lo[V], hi[V];  // features kV .. kV + V - 1 and the same R/2 further
        load_chunk<T, V>(xl, k, lo);
        load_chunk<T, V>(xl + half, k, hi);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int64_t j = k * V + i;
          rotate_pair<T, C>(lo[i], hi[i], cl, sl, j, j + half, p.backward);
        }
        store_chunk<T, V>(ol, k, lo);
        store_chunk<T, V>(ol + half, k, hi);
      }
    }
  }
}

// 16-byte items when every vector of x and out starts on a 16-byte boundary: the row strides,
// the rotation's vector boundaries (R/2 for rotate_half's second half, R for interleaved) and the
// pass-through part's start (R) and length (D - R) are multiples of a vector.
template <typename T>
bool vectors_fit(const RopeParams& p) {
  constexpr int kV = kVec<T>;
  const int64_t rotation_unit = p.interleaved ? p.rotary_dim : p.rotary_dim / 2;
  bool fits = rotation_unit % kV == 0 && p.rotary_dim % kV == 0 && (p.dim - p.rotary_dim) % kV == 0;
  for (int i = 0; i < 3; ++i) fits = fits && p.x_stride[i] % kV == 0 && p.out_stride[i] % kV == 0;
  return fits && aligned16(p.x) && aligned16(p.out);
}

template <typename T, int V, bool kInterleaved>
cudaError_t launch_for(const RopeParams& p, cudaStream_t stream) {
  const int64_t items = p.length * (rotation_items<V, kInterleaved>(p) + pass_through_items<V>(p));
  int64_t blocks_x = (items + kThreads - 1) / kThreads;
  blocks_x = blocks_x < 65535 ? blocks_x : 65535;
  const int64_t heads = p.batch * p.heads;
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(heads < 65535 ? heads : 65535));
  switch (p.cs_type) {
    case ElementType::kFloat32: rope_kernel<T, float, V, kInterleaved><<<grid, kThreads, 0, stream>>>(p); break;
    case ElementType::kFloat16: rope_kernel<T, __half, V, kInterleaved><<<grid, kThreads, 0, stream>>>(p); break;
    case ElementType::kBFloat16:
      rope_kernel<T, __nv_bfloat16, V, kInterleaved><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

template <typename T, int V>
cudaError_t launch_layout(const RopeParams& p, cudaStream_t stream) {
  return p.interleaved ? launch_for<T, V, true>(p, stream) : launch_for<T, V, false>(p, stream);
}

}  // namespace

cudaError_t launch_rope(const RopeParams& p, cudaStream_t stream) {
  if (p.rotary_dim <= 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.dim) return cudaErrorInvalidValue;
  if (p.batch * p.heads * p.length == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    return vectors_fit<T>(p) ? launch_layout<T, kVec<T>>(p, stream) : launch_layout<T, 1>(p, stream);
  });
}

}  // namespace kernels
}  // namespace hasten
