// The float32 router linear and its backward (router_linear.cuh): three GEMMs on the CUDA cores,
// one tiled kernel for all of them (operands of any layout, read in their own element type and
// widened to float32 on the way into shared memory).
//
// Why not cuBLAS's float32 GEMM: the router's GEMMs are thin (E = 64-256 columns) and the model's
// float32 path around them costs more than they do. On DeepSeek-V2-Lite's W3 block (16,384 tokens,
// H 2,048, E 64; H100) the forward's GEMM took 0.14 ms at 15 TFLOP/s, each backward GEMM 0.10, and
// the casts of x to float32 and of grad_x back about 0.17 more; the float32 copy of x (128 MiB) was
// kept for the weight gradient.
#include "dtype_utils.cuh"
#include "router_linear.cuh"

namespace hasten {
namespace kernels {
namespace {

// A block computes a kBM x kBN tile of C = A @ B over its part of K, kBK at a time; each of its
// kThreads threads owns kTM x kTN outputs (16 float32 accumulators).
constexpr int kBM = 32, kBN = 64, kBK = 32, kThreads = 128, kTM = 4, kTN = 4;
constexpr int kALoads = kBM * kBK / kThreads, kBLoads = kBK * kBN / kThreads;
static_assert((kBM / kTM) * (kBN / kTN) == kThreads, "one thread per kTM x kTN outputs");
// The weight gradient's sum over tokens is split until about this many blocks run.
constexpr int64_t kTargetBlocks = 1024;
constexpr int64_t kMinTokensPerSplit = 256;

// Element (r, c) of a rows x cols matrix at ptr[r * row_stride + c * col_stride].
template <typename T>
struct Operand {
  const T* ptr;
  int64_t row_stride, col_stride;
};

// A tile of R x C elements from (r0, c0), zeros outside [0, row_end) x [0, col_end), widened to
// float. Thread t takes elements t, t + kThreads, ... counted along the matrix's contiguous index
// (kColsContiguous: along c), so the loads coalesce and each thread keeps one fixed column (or
// row) and steps the other: one pointer increment per element.
template <bool kColsContiguous, int R, int C>
__device__ __forceinline__ void tile_coords(int i, int& r, int& c) {
  const int idx = threadIdx.x + i * kThreads;
  r = kColsContiguous ? idx / C : idx % R;
  c = kColsContiguous ? idx % C : idx / R;
}

template <bool kColsContiguous, typename T, int R, int C, int N>
__device__ __forceinline__ void load_tile(const Operand<T>& op, int64_t r0, int64_t c0, int64_t row_end,
                                          int64_t col_end, float (&regs)[N]) {
  int r_first, c_first;
  tile_coords<kColsContiguous, R, C>(0, r_first, c_first);
  // element i sits kThreads / C rows (or kThreads / R columns) after element i - 1
  const T* first = op.ptr + (r0 + r_first) * op.row_stride + (c0 + c_first) * op.col_stride;
  const int64_t step = kColsContiguous ? (kThreads / C) * op.row_stride : (kThreads / R) * op.col_stride;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    int r, c;
    tile_coords<kColsContiguous, R, C>(i, r, c);
    regs[i] = (r0 + r < row_end && c0 + c < col_end) ? to_float(first[i * step]) : 0.0f;
  }
}

// The same elements into shared memory, k-major: A's (m, k) at tile[k][m] (kTransposed), B's
// (k, n) at tile[k][n].
template <bool kColsContiguous, bool kTransposed, int R, int C, int N, int LD>
__device__ __forceinline__ void store_tile(const float (&regs)[N], float (*tile)[LD]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    int r, c;
    tile_coords<kColsContiguous, R, C>(i, r, c);
    if constexpr (kTransposed) tile[c][r] = regs[i];
    else tile[r][c] = regs[i];
  }
}

// C (M, N) = A (M, K) @ B (K, N) over K in [split * k_per_split, ...), float32 FFMA; blockIdx.z is
// the split, whose result goes to c + split * c_split_stride.
template <typename TA, typename TB, typename TC, bool kAColsContiguous, bool kBColsContiguous>
__global__ void __launch_bounds__(kThreads)
    ffma_gemm_kernel(Operand<TA> a, Operand<TB> b, TC* __restrict__ c, int64_t c_row_stride, int64_t m_size,
                     int64_t n_size, int64_t k_size, int64_t k_per_split, int64_t c_split_stride) {
  __shared__ __align__(16) float sa[2][kBK][kBM + 4];  // + 4: rows stay 16-byte aligned for float4 reads
  __shared__ __align__(16) float sb[2][kBK][kBN + 4];
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBM, n0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int64_t k_begin = static_cast<int64_t>(blockIdx.z) * k_per_split;
  const int64_t k_end = k_begin + k_per_split < k_size ? k_begin + k_per_split : k_size;
  const int ty = threadIdx.x / (kBN / kTN), tx = threadIdx.x % (kBN / kTN);

  float acc[kTM][kTN] = {};
  float ra[kALoads], rb[kBLoads];
  load_tile<kAColsContiguous, TA, kBM, kBK>(a, m0, k_begin, m_size, k_end, ra);
  load_tile<kBColsContiguous, TB, kBK, kBN>(b, k_begin, n0, k_end, n_size, rb);
  store_tile<kAColsContiguous, true, kBM, kBK>(ra, sa[0]);
  store_tile<kBColsContiguous, false, kBK, kBN>(rb, sb[0]);
  __syncthreads();
  int buffer = 0;
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kBK) {
    const bool next = k0 + kBK < k_end;
    if (next) {  // the next tiles' loads in flight while this one is multiplied
      load_tile<kAColsContiguous, TA, kBM, kBK>(a, m0, k0 + kBK, m_size, k_end, ra);
      load_tile<kBColsContiguous, TB, kBK, kBN>(b, k0 + kBK, n0, k_end, n_size, rb);
    }
#pragma unroll
    for (int k = 0; k < kBK; ++k) {
      const float4 av = *reinterpret_cast<const float4*>(&sa[buffer][k][ty * kTM]);
      const float4 bv = *reinterpret_cast<const float4*>(&sb[buffer][k][tx * kTN]);
      const float am[kTM] = {av.x, av.y, av.z, av.w}, bn[kTN] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) acc[i][j] = fmaf(am[i], bn[j], acc[i][j]);
    }
    if (next) {
      store_tile<kAColsContiguous, true, kBM, kBK>(ra, sa[buffer ^ 1]);
      store_tile<kBColsContiguous, false, kBK, kBN>(rb, sb[buffer ^ 1]);
    }
    __syncthreads();
    buffer ^= 1;
  }
  TC* out = c + static_cast<int64_t>(blockIdx.z) * c_split_stride;
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const int64_t m = m0 + ty * kTM + i;
    if (m >= m_size) continue;
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      const int64_t n = n0 + tx * kTN + j;
      if (n < n_size) out[m * c_row_stride + n] = from_float<TC>(acc[i][j]);
    }
  }
}

// out[i] = sum over s of partials[s * count + i], s in order, rounded once to T.
template <typename T>
__global__ void sum_splits_kernel(const float* __restrict__ partials, T* __restrict__ out, int64_t count,
                                  int64_t splits) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.0f;
    for (int64_t s = 0; s < splits; ++s) sum += partials[s * count + i];
    out[i] = from_float<T>(sum);
  }
}

template <bool kAColsContiguous, bool kBColsContiguous, typename TA, typename TB, typename TC>
cudaError_t launch_gemm(Operand<TA> a, Operand<TB> b, TC* c, int64_t c_row_stride, int64_t m, int64_t n, int64_t k,
                        int64_t splits, int64_t c_split_stride, cudaStream_t stream) {
  const int64_t k_per_split = (k + splits - 1) / splits;
  const dim3 grid(static_cast<unsigned>((m + kBM - 1) / kBM), static_cast<unsigned>((n + kBN - 1) / kBN),
                  static_cast<unsigned>(splits));
  ffma_gemm_kernel<TA, TB, TC, kAColsContiguous, kBColsContiguous><<<grid, kThreads, 0, stream>>>(a, b, c, c_row_stride, m, n, k, k_per_split,
                                                             c_split_stride);
  return cudaGetLastError();
}

// The grid's second dimension holds the tiles of N (at most 65,535).
bool n_tiles_fit(int64_t n) { return (n + kBN - 1) / kBN <= 65535; }

}  // namespace

int64_t router_linear_splits(int64_t tokens, int64_t hidden, int64_t experts) {
  const int64_t tiles = ((experts + kBM - 1) / kBM) * ((hidden + kBN - 1) / kBN);
  int64_t splits = (kTargetBlocks + tiles - 1) / tiles;
  const int64_t most = tokens / kMinTokensPerSplit;
  if (splits > most) splits = most;
  return splits > 1 ? (splits < 64 ? splits : 64) : 1;
}

int64_t router_linear_workspace_floats(int64_t tokens, int64_t hidden, int64_t experts) {
  return router_linear_splits(tokens, hidden, experts) * experts * hidden;
}

cudaError_t launch_router_linear(const RouterLinearParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.experts == 0) return cudaSuccess;
  if (!n_tiles_fit(p.experts)) return cudaErrorInvalidValue;
  if (p.hidden == 0) return cudaMemsetAsync(p.logits, 0, sizeof(float) * p.tokens * p.experts, stream);
  return HASTEN_DISPATCH_ELEMENT(p.x_type, {
    using X = T;
    return HASTEN_DISPATCH_ELEMENT(p.weight_type, {
      // A = x (T, H); B (k = h, n = e) = weight[e, h]; C = logits (T, E)
      const Operand<X> a{static_cast<const X*>(p.x), p.hidden, 1};
      const Operand<T> b{static_cast<const T*>(p.weight), 1, p.hidden};
      return launch_gemm<true, false>(a, b, p.logits, p.experts, p.tokens, p.experts, p.hidden, 1, 0, stream);
    });
  });
}

cudaError_t launch_router_linear_backward(const RouterLinearBackwardParams& p, cudaStream_t stream) {
  const int64_t t = p.tokens, h = p.hidden, e = p.experts;
  if (t * h * e == 0) {  // an empty sum: the gradients are zeros
    return HASTEN_DISPATCH_ELEMENT(p.x_type, {
      if (p.grad_x != nullptr && t * h > 0) {
        const cudaError_t err = cudaMemsetAsync(p.grad_x, 0, sizeof(T) * t * h, stream);
        if (err != cudaSuccess) return err;
      }
      return HASTEN_DISPATCH_ELEMENT(p.weight_type, {
        if (p.grad_weight != nullptr && e * h > 0) return cudaMemsetAsync(p.grad_weight, 0, sizeof(T) * e * h, stream);
        return cudaSuccess;
      });
    });
  }
  if (!n_tiles_fit(h)) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.x_type, {
    using X = T;
    return HASTEN_DISPATCH_ELEMENT(p.weight_type, {
      using W = T;
      const Operand<float> grad{p.grad_logits, e, 1};  // (T, E)
      if (p.grad_x != nullptr) {
        // grad_x (T, H) = grad (T, E) @ weight (E, H), rounded once to x's type
        const Operand<W> b{static_cast<const W*>(p.weight), h, 1};
        const cudaError_t err = launch_gemm<true, true>(grad, b, static_cast<X*>(p.grad_x), h, t, h, e, 1, 0, stream);
        if (err != cudaSuccess) return err;
      }
      if (p.grad_weight != nullptr) {
        // partial[s] (E, H) = grad[tokens of s]^T @ x[tokens of s]; then the splits summed in order
        const int64_t splits = router_linear_splits(t, h, e);
        const Operand<float> a{p.grad_logits, 1, e};  // (m = e, k = t) at grad[t, e]
        const Operand<X> b{static_cast<const X*>(p.x), h, 1};
        cudaError_t err = launch_gemm<false, true>(a, b, p.workspace, h, e, h, t, splits, e * h, stream);
        if (err != cudaSuccess) return err;
        const int64_t count = e * h;
        const int64_t blocks = (count + 255) / 256 < 4096 ? (count + 255) / 256 : 4096;
        sum_splits_kernel<W><<<blocks, 256, 0, stream>>>(p.workspace, static_cast<W*>(p.grad_weight), count, splits);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    });
  });
}

}  // namespace kernels
}  // namespace hasten
