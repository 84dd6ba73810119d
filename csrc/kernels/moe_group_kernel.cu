// MoE grouping in one cooperative launch, no host sync:
//   1. each block histograms its contiguous chunk of slots into shared memory and
//      publishes it to workspace[block][bucket];
//   2. grid-wide barrier;
//   3. every block reads all block histograms: per-bucket totals (-> counts, offsets by a
//      block scan) and the counts of earlier blocks (its base inside each bucket);
//   4. each block walks its chunk tile by tile and places every slot at
//      offsets[e] + base[e] + (earlier tiles) + (earlier warps of the tile) + (rank in warp),
//      which is the stable order. Buckets: experts 0..E-1, then bucket E for invalid ids.
#include <cooperative_groups.h>

#include "dtype_utils.cuh"
#include "moe.cuh"

namespace cg = cooperative_groups;

namespace hasten {
namespace kernels {
namespace {

constexpr int kGroupThreads = 512;
constexpr int kGroupWarps = kGroupThreads / 32;
constexpr int kMaxBuckets = kMoeMaxExperts + 1;

template <typename index_t>
__device__ __forceinline__ int bucket_of(const index_t* ids, int64_t s, int num_experts) {
  const index_t e = ids[s];
  return (e >= 0 && e < num_experts) ? static_cast<int>(e) : num_experts;
}

template <typename index_t>
__global__ void __launch_bounds__(kGroupThreads) moe_group_kernel(MoeGroupParams p) {
  const index_t* ids = static_cast<const index_t*>(p.expert_ids);
  const int buckets = p.num_experts + 1;
  const int64_t chunk = (p.num_slots + gridDim.x - 1) / gridDim.x;
  const int64_t begin = min(static_cast<int64_t>(blockIdx.x) * chunk, p.num_slots);
  const int64_t end = min(begin + chunk, p.num_slots);

  __shared__ int hist[kMaxBuckets];         // phase 1: this block's histogram
  __shared__ int bucket_start[kMaxBuckets]; // offsets[e] + this block's base in bucket e
  __shared__ int running[kMaxBuckets];      // slots of bucket e placed by earlier tiles
  __shared__ int warp_hist[kGroupWarps][kMaxBuckets];
  __shared__ int scan_carry;

  for (int e = threadIdx.x; e < buckets; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) atomicAdd(&hist[bucket_of(ids, s, p.num_experts)], 1);
  __syncthreads();
  int32_t* block_hist = p.workspace + static_cast<int64_t>(blockIdx.x) * buckets;
  for (int e = threadIdx.x; e < buckets; e += blockDim.x) block_hist[e] = hist[e];

  cg::this_grid().sync();

  // Totals and this block's base per bucket; `hist` now holds totals.
  for (int e = threadIdx.x; e < buckets; e += blockDim.x) {
    int total = 0, base = 0;
    for (int b = 0; b < static_cast<int>(gridDim.x); ++b) {
      const int c = p.workspace[static_cast<int64_t>(b) * buckets + e];
      total += c;
      base += b < static_cast<int>(blockIdx.x) ? c : 0;
    }
    hist[e] = total;
    bucket_start[e] = base;
    running[e] = 0;
  }
  if (threadIdx.x == 0) scan_carry = 0;
  __syncthreads();
  // Exclusive scan of totals over buckets, blockDim buckets at a time (warp shuffles).
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int first = 0; first < buckets; first += blockDim.x) {
    const int e = first + threadIdx.x;
    const int value = e < buckets ? hist[e] : 0;
    int inclusive = value;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += other;
    }
    if (lane == 31) warp_hist[0][warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
      int w = lane < kGroupWarps ? warp_hist[0][lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, w, d);
        if (lane >= d) w += other;
      }
      if (lane < kGroupWarps) warp_hist[0][lane] = w;
    }
    __syncthreads();
    const int exclusive = scan_carry + (warp > 0 ? warp_hist[0][warp - 1] : 0) + inclusive - value;
    if (e < buckets) {
      bucket_start[e] += exclusive;
      if (blockIdx.x == 0) {
        p.offsets[e] = exclusive;
        if (e < p.num_experts) p.counts[e] = value;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) scan_carry += warp_hist[0][kGroupWarps - 1];
    __syncthreads();
  }

  // Stable placement, one tile of blockDim slots at a time.
  const unsigned lanes_before = (1u << lane) - 1u;
  for (int64_t tile = begin; tile < end; tile += blockDim.x) {
    for (int i = threadIdx.x; i < kGroupWarps * buckets; i += blockDim.x) warp_hist[i / buckets][i % buckets] = 0;
    __syncthreads();
    const int64_t s = tile + threadIdx.x;
    const bool active = s < end;
    const int e = active ? bucket_of(ids, s, p.num_experts) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & lanes_before);
    if (active && rank == 0) warp_hist[warp][e] = __popc(peers);
    __syncthreads();
    if (active) {
      int pos = bucket_start[e] + running[e] + rank;
      for (int w = 0; w < warp; ++w) pos += warp_hist[w][e];
      p.permutation[pos] = static_cast<int32_t>(s);
      p.inverse[s] = pos;
    }
    __syncthreads();
    for (int b = threadIdx.x; b < buckets; b += blockDim.x) {
      int placed = 0;
      for (int w = 0; w < kGroupWarps; ++w) placed += warp_hist[w][b];
      running[b] += placed;
    }
    __syncthreads();
  }
}

template <typename index_t>
int max_grid(int device) {
  int sms = 0, per_sm = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_group_kernel<index_t>, kGroupThreads, 0);
  return sms * (per_sm > 0 ? per_sm : 1);
}

int grid_for(int64_t num_slots, bool ids_int64, int device) {
  const int64_t wanted = (num_slots + kGroupThreads - 1) / kGroupThreads;  // about one tile per block
  const int cap = ids_int64 ? max_grid<int64_t>(device) : max_grid<int32_t>(device);
  return static_cast<int>(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

}  // namespace

int64_t moe_group_workspace_ints(int64_t num_slots, int num_experts, int device) {
  return static_cast<int64_t>(grid_for(num_slots, true, device)) * (num_experts + 1);
}

cudaError_t launch_moe_group(const MoeGroupParams& params, int device, cudaStream_t stream) {
  if (params.num_experts < 1 || params.num_experts > kMoeMaxExperts) return cudaErrorInvalidValue;
  if (params.num_slots == 0) {
    cudaError_t err = cudaMemsetAsync(params.counts, 0, sizeof(int32_t) * params.num_experts, stream);
    if (err != cudaSuccess) return err;
    return cudaMemsetAsync(params.offsets, 0, sizeof(int32_t) * (params.num_experts + 1), stream);
  }
  // The int64 kernel's occupancy bounds the workspace; the int32 one may not exceed it.
  const int grid = min(grid_for(params.num_slots, params.ids_int64, device), grid_for(params.num_slots, true, device));
  MoeGroupParams p = params;
  void* args[] = {&p};
  const void* fn = params.ids_int64 ? reinterpret_cast<const void*>(&moe_group_kernel<int64_t>)
                                    : reinterpret_cast<const void*>(&moe_group_kernel<int32_t>);
  return cudaLaunchCooperativeKernel(fn, dim3(grid), dim3(kGroupThreads), args, 0, stream);
}

}  // namespace kernels
}  // namespace hasten
