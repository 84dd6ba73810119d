// Rotary embedding on q or k, forward or backward, full or partial, rotate_half or interleaved
// pairs (rope.cuh). blockIdx.x walks the (batch, position, item) work, blockIdx.y chunks of heads
// that one thread covers with one read of cos and sin (rope_kernel). A position's row is split
// into items, in one launch:
//   rotation items      first R features; rotate_half: V pairs (j, j + R/2), V consecutive
//                       elements read from each half; interleaved: V consecutive elements holding
//                       V/2 pairs (2j, 2j + 1) (one pair, two scalar reads, when V = 1)
//   pass-through items  V consecutive features of R..D-1, copied (partial rotary)
// V = 16 bytes of elements where strides, R, D - R and pointers allow it, else V = 1. Index
// arithmetic happens once per item, not per element.
#include "dtype_utils.cuh"
#include "rope.cuh"
#include "rope_math.cuh"

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

// Heads one thread rotates with the cos and sin it loaded once (q's 32 heads: 8 threads): their
// loads (8 of 16 bytes) in flight together, at about 110 registers (two blocks an SM).
constexpr int kHeadsPerThread = 4;

// blockIdx.x / threadIdx.x walk the (batch, position, item) work, blockIdx.y the chunks of
// kHeadsPerThread heads: a thread reads its item's cos and sin once (16-byte loads where they
// allow it) and applies them to that item of each head of its chunk. (One head per thread, with
// cos and sin read per element, ran at about half a copy's bandwidth: W4's profile on H200.)
template <typename T, typename C, int V, bool kInterleaved, bool kAngleVectors>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t half = p.rotary_dim / 2;
  const int64_t rotate = rotation_items<V, kInterleaved>(p);
  const int64_t items_per_row = rotate + pass_through_items<V>(p);
  const int64_t items = p.batch * p.length * items_per_row;
  const C* cos = static_cast<const C*>(p.cos);
  const C* sin = static_cast<const C*>(p.sin);
  const int64_t chunks = (p.heads + kHeadsPerThread - 1) / kHeadsPerThread;
  for (int64_t chunk = blockIdx.y; chunk < chunks; chunk += gridDim.y) {
    const int64_t first_head = chunk * kHeadsPerThread;
    const int heads = static_cast<int>(p.heads - first_head < kHeadsPerThread ? p.heads - first_head : kHeadsPerThread);
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
         item += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t bl = item / items_per_row, k = item - bl * items_per_row;
      const int64_t b = bl / p.length, l = bl - b * p.length;
      const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + first_head * p.x_stride[1] + l * p.x_stride[2];
      T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + first_head * p.out_stride[1] + l * p.out_stride[2];
      if (k >= rotate) {  // features R..D-1: unchanged, forward and backward
        for (int h = 0; h < heads; ++h) {
          T e[V];
          load_chunk<T, V>(x + h * p.x_stride[1] + p.rotary_dim, k - rotate, e);
          store_chunk<T, V>(out + h * p.out_stride[1] + p.rotary_dim, k - rotate, e);
        }
        continue;
      }
      const C* cl = cos + b * p.cs_stride[0] + l * p.cs_stride[1];
      const C* sl = sin + b * p.cs_stride[0] + l * p.cs_stride[1];
      // Every head's loads are issued before the first store: the compiler cannot move a load
      // above a store to `out` itself (x and out may alias as far as it knows).
      if constexpr (kInterleaved) {
        constexpr int kPairs = kPairsPerItem<V, true>;
        C c[2 * kPairs], s[2 * kPairs];  // features 2 kPairs k .. 2 kPairs (k + 1) - 1
        load_angles<C, 2 * kPairs, kAngleVectors>(cl, 2 * kPairs * k, c);
        load_angles<C, 2 * kPairs, kAngleVectors>(sl, 2 * kPairs * k, s);
        T e[kHeadsPerThread][2 * kPairs];  // pairs (e[h][2i], e[h][2i+1])
#pragma unroll
        for (int h = 0; h < kHeadsPerThread; ++h)
          if (h < heads) load_elements<T, 2 * kPairs>(x + h * p.x_stride[1], k, e[h]);
#pragma unroll
        for (int h = 0; h < kHeadsPerThread; ++h) {
          if (h >= heads) break;
#pragma unroll
          for (int i = 0; i < kPairs; ++i)
            rotate_pair<T, C>(e[h][2 * i], e[h][2 * i + 1], c[2 * i], c[2 * i + 1], s[2 * i], s[2 * i + 1],
                              p.backward);
          store_elements<T, 2 * kPairs>(out + h * p.out_stride[1], k, e[h]);
        }
      } else {
        C c_lo[V], c_hi[V], s_lo[V], s_hi[V];  // features kV .. kV + V - 1 and R/2 further
        load_angles<C, V, kAngleVectors>(cl, k * V, c_lo);
        load_angles<C, V, kAngleVectors>(cl, half + k * V, c_hi);
        load_angles<C, V, kAngleVectors>(sl, k * V, s_lo);
        load_angles<C, V, kAngleVectors>(sl, half + k * V, s_hi);
        T lo[kHeadsPerThread][V], hi[kHeadsPerThread][V];
#pragma unroll
        for (int h = 0; h < kHeadsPerThread; ++h) {
          if (h >= heads) continue;
          load_chunk<T, V>(x + h * p.x_stride[1], k, lo[h]);
          load_chunk<T, V>(x + h * p.x_stride[1] + half, k, hi[h]);
        }
#pragma unroll
        for (int h = 0; h < kHeadsPerThread; ++h) {
          if (h >= heads) break;
          T* oh = out + h * p.out_stride[1];
#pragma unroll
          for (int i = 0; i < V; ++i)
            rotate_pair<T, C>(lo[h][i], hi[h][i], c_lo[i], c_hi[i], s_lo[i], s_hi[i], p.backward);
          store_chunk<T, V>(oh, k, lo[h]);
          store_chunk<T, V>(oh + half, k, hi[h]);
        }
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

// Whether cos and sin can be read as 16-byte vectors: each item reads V consecutive values
// (2 kPairs interleaved) at multiples of V from the row start and from R/2; those values must fill
// whole vectors, and the rows and R/2 must start on vector boundaries.
template <typename C, int N>
bool angle_vectors_fit(const RopeParams& p) {
  constexpr int64_t kPer = 16 / sizeof(C);
  if ((N * static_cast<int64_t>(sizeof(C))) % 16 != 0) return false;
  return aligned16(p.cos) && aligned16(p.sin) && p.cs_stride[0] % kPer == 0 && p.cs_stride[1] % kPer == 0 &&
         (p.rotary_dim / 2) % kPer == 0;
}

template <typename T, typename C, int V, bool kInterleaved>
cudaError_t launch_angles(const RopeParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int N = kInterleaved ? 2 * kPairsPerItem<V, true> : V;
  if constexpr ((N * sizeof(C)) % 16 == 0) {
    if (angle_vectors_fit<C, N>(p)) {
      rope_kernel<T, C, V, kInterleaved, true><<<grid, kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    }
  }
  rope_kernel<T, C, V, kInterleaved, false><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int V, bool kInterleaved>
cudaError_t launch_for(const RopeParams& p, cudaStream_t stream) {
  const int64_t items = p.batch * p.length * (rotation_items<V, kInterleaved>(p) + pass_through_items<V>(p));
  int64_t blocks_x = (items + kThreads - 1) / kThreads;
  blocks_x = blocks_x < (1 << 20) ? blocks_x : (1 << 20);  // the kernel loops past this
  const int64_t chunks = (p.heads + kHeadsPerThread - 1) / kHeadsPerThread;
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
  switch (p.cs_type) {
    case ElementType::kFloat32: return launch_angles<T, float, V, kInterleaved>(p, grid, stream);
    case ElementType::kFloat16: return launch_angles<T, __half, V, kInterleaved>(p, grid, stream);
    case ElementType::kBFloat16: return launch_angles<T, __nv_bfloat16, V, kInterleaved>(p, grid, stream);
  }
  return cudaErrorInvalidValue;
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
