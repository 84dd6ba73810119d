// Single-block varlen_meta: walks the tokens in tiles of kThreads * kItems; inside a
// tile each thread flags the sequence starts of kItems consecutive tokens, a block
// scan turns flags into sequence indices, and a running carry links the tiles.
// The max sequence length is a block max-reduction over the finished cu_seqlens.
#include "varlen_meta.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kItems = 4;
constexpr int kWarps = kThreads / 32;

template <typename index_t>
__device__ __forceinline__ bool is_sequence_start(const index_t* pos, int64_t i, int64_t row_len) {
  return (i % row_len == 0) || (pos[i] != pos[i - 1] + 1);
}

// Exclusive block scan of one int per thread; returns the block total in *total.
__device__ __forceinline__ int block_exclusive_scan(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += other;
    }
    if (lane < kWarps) warp_sums[lane] = w;  // inclusive prefix over warps
  }
  __syncthreads();
  const int warp_prefix = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return warp_prefix + inclusive - value;
}

template <typename index_t>
__global__ void __launch_bounds__(kThreads) varlen_meta_kernel(const index_t* __restrict__ pos,
                                                                int64_t total, int64_t row_len,
                                                                int32_t* __restrict__ cu,
                                                                int32_t* __restrict__ seq_idx,
                                                                int32_t* __restrict__ stats) {
  __shared__ int warp_sums[kWarps];
  __shared__ int reduce_buf[kWarps];
  int carry = 0;  // sequences started before this tile

  for (int64_t tile = 0; tile < total; tile += static_cast<int64_t>(kThreads) * kItems) {
    const int64_t first = tile + static_cast<int64_t>(threadIdx.x) * kItems;
    bool start[kItems];
    int count = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = first + j;
      start[j] = i < total && is_sequence_start(pos, i, row_len);
      count += start[j] ? 1 : 0;
    }
    int tile_total = 0;
    int seq = carry + block_exclusive_scan(count, warp_sums, &tile_total);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = first + j;
      if (i < total) {
        if (start[j]) cu[seq++] = static_cast<int32_t>(i);
        seq_idx[i] = seq - 1;
      }
    }
    carry += tile_total;
  }

  const int num_seqs = carry;
  for (int64_t k = num_seqs + threadIdx.x; k <= total; k += kThreads) cu[k] = static_cast<int32_t>(total);
  __syncthreads();  // cu_seqlens complete and visible to the whole block

  int local_max = 0;
  for (int k = threadIdx.x; k < num_seqs; k += kThreads) local_max = max(local_max, cu[k + 1] - cu[k]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    local_max = max(local_max, __shfl_xor_sync(0xffffffffu, local_max, offset));
  if ((threadIdx.x & 31) == 0) reduce_buf[threadIdx.x >> 5] = local_max;
  __syncthreads();
  if (threadIdx.x == 0) {
    int m = 0;
    for (int w = 0; w < kWarps; ++w) m = max(m, reduce_buf[w]);
    stats[0] = num_seqs;
    stats[1] = m;
  }
}

}  // namespace

cudaError_t launch_varlen_meta(const VarlenMetaParams& p, cudaStream_t stream) {
  if (p.position_ids_int64) {
    varlen_meta_kernel<int64_t><<<1, kThreads, 0, stream>>>(
        static_cast<const int64_t*>(p.position_ids), p.total, p.row_len, p.cu_seqlens, p.seq_idx, p.stats);
  } else {
    varlen_meta_kernel<int32_t><<<1, kThreads, 0, stream>>>(
        static_cast<const int32_t*>(p.position_ids), p.total, p.row_len, p.cu_seqlens, p.seq_idx, p.stats);
  }
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace hasten
