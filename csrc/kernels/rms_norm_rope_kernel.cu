// Fused head norm + rotary embedding, forward and backward (rms_norm_rope.cuh). A row (one head
// of one token) is D / V 16-byte vectors, held one per lane by a group of `group` lanes of one
// warp (a power of two: 16 lanes for D = 128 in bf16), so the row's sums are warp shuffles.
// rotate_half pairs feature j with j + R/2, which sits (R/2) / V lanes away: a lane gets the other
// side's vector with four 32-bit shuffles. Interleaved pairs sit inside one vector.
//
// The same sums as hasten::rms_norm's kernels on the same row (a lane's V squares in order, then
// the group's xor tree; the backward's dot likewise) and the same roundings as rms_norm then rope
// (y, and backward g, rounded to T between them; rope_math.cuh's expressions): the fused op gives
// the values of the two ops one after the other.
//
// Rows are visited in (b, l, h) order, heads innermost: x's memory order for q and k transposed
// from (B, L, H, D), and a position's cos and sin are read by all its heads while in L1.
//
// Backward, the weight gradient: each lane sums g * round_to_T(n) of its own columns over the rows
// it visits, in registers; then each group writes its sums to its own row of shared memory and
// the block adds those rows in a fixed order into its partial (no atomics: the same partials on
// every run).
#include <cstring>

#include "dtype_utils.cuh"
#include "rms_norm_rope.cuh"
#include "rope_math.cuh"
#include "warp_sums.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxVector = 8;  // elements of a 16-byte vector of 16-bit types

// The vector lane `source` of this warp holds (every lane of the warp must call it).
template <typename T, int V>
__device__ __forceinline__ void vector_from_lane(const T (&mine)[V], T (&theirs)[V], int source) {
  static_assert(V * sizeof(T) == 16, "one 16-byte vector");
  uint32_t words[4];
  memcpy(words, mine, 16);
#pragma unroll
  for (int k = 0; k < 4; ++k) words[k] = __shfl_sync(0xffffffff, words[k], source);
  memcpy(theirs, words, 16);
}

template <typename T, int V>
__device__ __forceinline__ void fill_zero(T (&chunk)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) chunk[i] = from_float<T>(0.f);
}

// What a lane does in every row it visits: its vector v, and where the vector it pairs with is.
struct LaneRole {
  int v;           // this lane's vector of the row
  int partner;     // the lane (of the warp) holding the other side of v's rotary pairs
  bool holds;      // v < D / V (a row of fewer vectors than the group's lanes leaves some idle)
  bool rotates;    // v < R / V: the features rotate (else they pass through)
  bool lo;         // rotate_half: v holds the pairs' first sides (features below R/2)
};

template <int V>
__device__ __forceinline__ LaneRole lane_role(const RmsNormRopeParams& p, int group) {
  const int lane = threadIdx.x % 32;
  LaneRole role;
  role.v = lane % group;
  const int half = static_cast<int>(p.rotary_dim / 2 / V);  // rotate_half: the pair's distance in vectors
  role.holds = role.v < p.dim / V;
  role.rotates = role.v < p.rotary_dim / V;
  role.lo = role.v < half;
  const int other = p.interleaved || !role.rotates ? role.v : (role.lo ? role.v + half : role.v - half);
  role.partner = lane - role.v + other;
  return role;
}

// Rows of the whole tensor, walked per warp. A trip covers kRows * (32 / group) rows per warp:
// a lane's rows on a trip are first + k * (32 / group), k < kRows, every load of all of them issued
// before the first use (with one row a lane at a time the head norms ran at 2.5-2.8 TB/s and this
// kernel at 1.5, H100 db7c036: too few bytes in flight). Every lane takes the same trips (the
// shuffles need the whole warp), also past the last row.
template <int kRows>
struct RowWalk {
  uint32_t first;  // the warp's first row on its first trip
  uint32_t step;   // rows between trips
  uint32_t apart;  // rows between a lane's rows on one trip: the warp's row groups
  uint32_t lane_row;

  __device__ __forceinline__ explicit RowWalk(int group) {
    const uint32_t warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
    apart = 32 / group;
    first = warp * apart * kRows;
    step = gridDim.x * (kThreads / 32) * apart * kRows;
    lane_row = (threadIdx.x % 32) / group;
  }
  __device__ __forceinline__ uint32_t row(uint32_t trip_first, int k) const { return trip_first + k * apart + lane_row; }
};

struct RowIndex {
  uint32_t b, h, l;
};

// Row r of the (b, l, h) order (heads innermost).
__device__ __forceinline__ RowIndex row_index(uint32_t row, uint32_t heads, uint32_t length) {
  const uint32_t bl = row / heads;
  return {bl / length, row - bl * heads, bl % length};
}

template <typename T>
__device__ __forceinline__ const T* row_of(const void* base, const int64_t (&stride)[3], RowIndex r) {
  return static_cast<const T*>(base) + r.b * stride[0] + r.h * stride[1] + r.l * stride[2];
}

__device__ __forceinline__ int64_t rstd_index(const RmsNormRopeParams& p, RowIndex r) {
  return (static_cast<int64_t>(r.b) * p.heads + r.h) * p.length + r.l;
}

template <typename T, bool kInterleaved, int kRows>
__global__ void __launch_bounds__(kThreads) rms_norm_rope_forward_kernel(RmsNormRopeParams p, int group) {
  constexpr int V = kVec<T>;
  const LaneRole role = lane_role<V>(p, group);
  T weight[V];
  if (role.holds) load_chunk<T, V>(static_cast<const T*>(p.weight), role.v, weight);
  const uint32_t rows = static_cast<uint32_t>(p.batch * p.heads * p.length);
  const RowWalk<kRows> walk(group);
  for (uint32_t trip = walk.first; trip < rows; trip += walk.step) {
    T xs[kRows][V], c[kRows][V], s[kRows][V];
    RowIndex r[kRows];
    bool active[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {  // every row's loads first
      const uint32_t row = walk.row(trip, k);
      active[k] = row < rows && role.holds;
      r[k] = row_index(row < rows ? row : 0, p.heads, p.length);
      if (active[k]) {
        load_chunk<T, V>(row_of<T>(p.x, p.x_stride, r[k]), role.v, xs[k]);
        if (role.rotates) {
          const int64_t position = r[k].b * p.cs_stride[0] + r[k].l * p.cs_stride[1];
          load_chunk<T, V>(static_cast<const T*>(p.cos) + position, role.v, c[k]);
          load_chunk<T, V>(static_cast<const T*>(p.sin) + position, role.v, s[k]);
        }
      } else {
        fill_zero(xs[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      float squares = 0.f;
#pragma unroll
      for (int i = 0; i < V; ++i) squares += to_float(xs[k][i]) * to_float(xs[k][i]);
      const float rstd = rsqrtf(group_sum(squares, group) / static_cast<float>(p.dim) + p.eps);
      T ys[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float normalised = to_float(from_float<T>(to_float(xs[k][i]) * rstd));
        ys[i] = from_float<T>((active[k] ? to_float(weight[i]) + p.offset : 0.f) * normalised);
      }
      T other[V];  // rotate_half: the other side of this lane's pairs
      if constexpr (!kInterleaved) vector_from_lane<T, V>(ys, other, role.partner);
      if (!active[k]) continue;
      if (role.v == 0) p.rstd[rstd_index(p, r[k])] = rstd;
      T out[V];
      if (!role.rotates) {
#pragma unroll
        for (int i = 0; i < V; ++i) out[i] = ys[i];
      } else if constexpr (kInterleaved) {
#pragma unroll
        for (int i = 0; i < V; i += 2) {
          const float a = to_float(ys[i]), b = to_float(ys[i + 1]);
          out[i] = from_float<T>(rotated_lo(a, b, to_float(c[k][i]), to_float(s[k][i]), false));
          out[i + 1] = from_float<T>(rotated_hi(a, b, to_float(c[k][i + 1]), to_float(s[k][i + 1]), false));
        }
      } else if (role.lo) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          out[i] = from_float<T>(
              rotated_lo(to_float(ys[i]), to_float(other[i]), to_float(c[k][i]), to_float(s[k][i]), false));
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i)
          out[i] = from_float<T>(
              rotated_hi(to_float(other[i]), to_float(ys[i]), to_float(c[k][i]), to_float(s[k][i]), false));
      }
      T* destination =
          static_cast<T*>(p.out) + r[k].b * p.out_stride[0] + r[k].h * p.out_stride[1] + r[k].l * p.out_stride[2];
      store_chunk<T, V>(destination, role.v, out);
    }
  }
}

template <typename T, bool kInterleaved, bool kWeightGrad, int kRows>
__global__ void __launch_bounds__(kThreads) rms_norm_rope_backward_kernel(RmsNormRopeParams p, int group) {
  constexpr int V = kVec<T>;
  // (groups of the block, D): one row of weight-gradient sums per group of lanes; D <= group * V
  __shared__ float group_sums[kThreads * kMaxVector];
  const LaneRole role = lane_role<V>(p, group);
  T weight[V];
  float grad_weight[V];
#pragma unroll
  for (int i = 0; i < V; ++i) grad_weight[i] = 0.f;
  if (role.holds) load_chunk<T, V>(static_cast<const T*>(p.weight), role.v, weight);
  const uint32_t rows = static_cast<uint32_t>(p.batch * p.heads * p.length);
  const RowWalk<kRows> walk(group);
  // the sin a lane's pairs need backward is the other side's (rope_math.cuh): its vector index
  const int sin_vector = p.interleaved ? role.v : role.partner - (static_cast<int>(threadIdx.x % 32) - role.v);
  for (uint32_t trip = walk.first; trip < rows; trip += walk.step) {
    T xs[kRows][V], ds[kRows][V], c[kRows][V], s[kRows][V];
    float rstd[kRows];
    RowIndex r[kRows];
    bool active[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k) {  // every row's loads first
      const uint32_t row = walk.row(trip, k);
      active[k] = row < rows && role.holds;
      r[k] = row_index(row < rows ? row : 0, p.heads, p.length);
      rstd[k] = 0.f;
      if (active[k]) {
        load_chunk<T, V>(row_of<T>(p.grad_out, p.grad_stride, r[k]), role.v, ds[k]);
        load_chunk<T, V>(row_of<T>(p.x, p.x_stride, r[k]), role.v, xs[k]);
        rstd[k] = p.rstd[rstd_index(p, r[k])];
        if (role.rotates) {
          const int64_t position = r[k].b * p.cs_stride[0] + r[k].l * p.cs_stride[1];
          load_chunk<T, V>(static_cast<const T*>(p.cos) + position, role.v, c[k]);
          load_chunk<T, V>(static_cast<const T*>(p.sin) + position, sin_vector, s[k]);
        }
      } else {
        fill_zero(xs[k]);
        fill_zero(ds[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      T other[V];
      if constexpr (!kInterleaved) vector_from_lane<T, V>(ds[k], other, role.partner);
      // g = rope^T(grad_out), rounded as hasten::rope's backward output is
      T gs[V];
      if (!active[k] || !role.rotates) {
#pragma unroll
        for (int i = 0; i < V; ++i) gs[i] = ds[k][i];
      } else if constexpr (kInterleaved) {
#pragma unroll
        for (int i = 0; i < V; i += 2) {
          const float a = to_float(ds[k][i]), b = to_float(ds[k][i + 1]);
          gs[i] = from_float<T>(rotated_lo(a, b, to_float(c[k][i]), to_float(s[k][i + 1]), true));
          gs[i + 1] = from_float<T>(rotated_hi(a, b, to_float(c[k][i + 1]), to_float(s[k][i]), true));
        }
      } else if (role.lo) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          gs[i] = from_float<T>(
              rotated_lo(to_float(ds[k][i]), to_float(other[i]), to_float(c[k][i]), to_float(s[k][i]), true));
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i)
          gs[i] = from_float<T>(
              rotated_hi(to_float(other[i]), to_float(ds[k][i]), to_float(c[k][i]), to_float(s[k][i]), true));
      }
      float dot = 0.f;
      if (active[k]) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          dot += (to_float(weight[i]) + p.offset) * to_float(gs[i]) * (to_float(xs[k][i]) * rstd[k]);
      }
      const float mean_dot = group_sum(dot, group) / static_cast<float>(p.dim);
      if (!active[k]) continue;
      T grad_x[V];
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = to_float(xs[k][i]) * rstd[k];
        const float gy = to_float(gs[i]);
        if constexpr (kWeightGrad) grad_weight[i] += gy * to_float(from_float<T>(n));
        grad_x[i] = from_float<T>(rstd[k] * ((to_float(weight[i]) + p.offset) * gy - n * mean_dot));
      }
      T* destination =
          static_cast<T*>(p.out) + r[k].b * p.out_stride[0] + r[k].h * p.out_stride[1] + r[k].l * p.out_stride[2];
      store_chunk<T, V>(destination, role.v, grad_x);
    }
  }
  if constexpr (kWeightGrad) {
    const int group_of_block = threadIdx.x / group;
    if (role.holds) {
#pragma unroll
      for (int i = 0; i < V; ++i) group_sums[group_of_block * p.dim + role.v * V + i] = grad_weight[i];
    }
    __syncthreads();
    float* partial = p.grad_weight_partial + static_cast<int64_t>(blockIdx.x) * p.dim;
    for (int64_t column = threadIdx.x; column < p.dim; column += kThreads) {
      float total = 0.f;
      for (int g = 0; g < kThreads / group; ++g) total += group_sums[g * p.dim + column];
      partial[column] = total;
    }
  }
}

bool strides_fit(const int64_t (&stride)[3], int vector) {
  return stride[0] % vector == 0 && stride[1] % vector == 0 && stride[2] % vector == 0;
}

// Shapes, strides and pointers the kernels take (see rms_norm_rope.cuh).
bool params_fit(const RmsNormRopeParams& p, int element_bytes, bool backward) {
  const int vector = 16 / element_bytes;
  if (!rms_norm_rope_fits(p.dim, p.rotary_dim, p.interleaved, element_bytes)) return false;
  if (p.batch * p.heads * p.length >= (int64_t(1) << 31)) return false;  // 32-bit row indices
  bool fits = strides_fit(p.x_stride, vector) && strides_fit(p.out_stride, vector) &&
              p.cs_stride[0] % vector == 0 && p.cs_stride[1] % vector == 0;
  fits = fits && aligned16(p.x) && aligned16(p.out) && aligned16(p.weight) && aligned16(p.cos) && aligned16(p.sin);
  if (backward) fits = fits && strides_fit(p.grad_stride, vector) && aligned16(p.grad_out);
  return fits;
}

// Rows a lane handles per trip. The forward takes two (its loads of the second row in flight with
// the first row's sums): on an H100 (192bd15) q 77.8 us against 89.1 with one, k 41.8 against 47.7.
// The backward keeps one: with two it took 114.9 against 108.5 us on q and 65.3 against 55.0 on k
// (more registers live across its two reductions), so it is launched with kRows = 1 only.
constexpr int kForwardRowsPerLane = 2;
constexpr int kBackwardRowsPerLane = 1;

unsigned forward_blocks(int64_t rows, int group, int rows_per_lane) {
  const int64_t rows_per_block = static_cast<int64_t>(kThreads / group) * rows_per_lane;
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20));  // the kernel loops past this
}

template <typename T, int kRows>
cudaError_t launch_forward_rows(const RmsNormRopeParams& p, cudaStream_t stream) {
  const int group = lanes_per_row(p.dim / kVec<T>);
  const unsigned blocks = forward_blocks(p.batch * p.heads * p.length, group, kRows);
  if (p.interleaved) {
    rms_norm_rope_forward_kernel<T, true, kRows><<<blocks, kThreads, 0, stream>>>(p, group);
  } else {
    rms_norm_rope_forward_kernel<T, false, kRows><<<blocks, kThreads, 0, stream>>>(p, group);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_forward(const RmsNormRopeParams& p, cudaStream_t stream) {
  return launch_forward_rows<T, kForwardRowsPerLane>(p, stream);
}

template <typename T, bool kInterleaved, int kRows>
cudaError_t launch_backward_layout(const RmsNormRopeParams& p, int blocks, int group, cudaStream_t stream) {
  if (p.grad_weight_partial != nullptr) {
    rms_norm_rope_backward_kernel<T, kInterleaved, true, kRows><<<blocks, kThreads, 0, stream>>>(p, group);
  } else {
    rms_norm_rope_backward_kernel<T, kInterleaved, false, kRows><<<blocks, kThreads, 0, stream>>>(p, group);
  }
  return cudaGetLastError();
}

template <typename T, int kRows>
cudaError_t launch_backward_rows(const RmsNormRopeParams& p, int blocks, cudaStream_t stream) {
  const int group = lanes_per_row(p.dim / kVec<T>);
  return p.interleaved ? launch_backward_layout<T, true, kRows>(p, blocks, group, stream)
                       : launch_backward_layout<T, false, kRows>(p, blocks, group, stream);
}

template <typename T>
cudaError_t launch_backward(const RmsNormRopeParams& p, int blocks, cudaStream_t stream) {
  return launch_backward_rows<T, kBackwardRowsPerLane>(p, blocks, stream);
}

}  // namespace

bool rms_norm_rope_fits(int64_t dim, int64_t rotary_dim, bool interleaved, int element_bytes) {
  if (element_bytes <= 0 || 16 % element_bytes != 0) return false;
  const int64_t vector = 16 / element_bytes;
  if (dim <= 0 || dim % vector != 0 || dim / vector > 32) return false;
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > dim) return false;
  return interleaved ? rotary_dim % vector == 0 : (rotary_dim / 2) % vector == 0;
}

cudaError_t launch_rms_norm_rope_forward(const RmsNormRopeParams& p, cudaStream_t stream) {
  if (p.batch * p.heads * p.length == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    if (!params_fit(p, sizeof(T), false)) return cudaErrorInvalidValue;
    return launch_forward<T>(p, stream);
  });
}

cudaError_t launch_rms_norm_rope_backward(const RmsNormRopeParams& p, int blocks, cudaStream_t stream) {
  if (p.batch * p.heads * p.length == 0) return cudaSuccess;  // the caller zeroes an empty input's partials
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    if (!params_fit(p, sizeof(T), true)) return cudaErrorInvalidValue;
    return launch_backward<T>(p, blocks, stream);
  });
}

}  // namespace kernels
}  // namespace hasten
