// Cross-entropy over rows of LM-head logits, gradient written in place (see cross_entropy.cuh).
// Two passes over a row: an online max/sum-exp, then the gradient. 16-byte vector loads when the
// row stride and base allow it (vocab sizes like 151936 and 128256 do); one element per load
// otherwise (the same kernel with V = 1).
//
// Experimental, sm_90, HASTEN_CE_CLUSTER=1: the row held in shared memory, so that the gradient
// pass reads it from there and not from HBM again (two passes over the logits instead of three:
// W1's 5 GB of logits a step took 4.56 ms at 3.3 TB/s over three passes). A row of Qwen3's vocab
// is 304 KB in bf16, more than one multiprocessor's shared memory, so a thread-block cluster of C
// blocks holds it, a slice each (at most kClusterSliceBytes), and the blocks combine their
// (max, sum-exp, sum) through distributed shared memory in rank order. Off until measured.
#include <cooperative_groups.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cross_entropy.cuh"
#include "dtype_utils.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max, sum;  // sum of exp(z - max)
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.max == -INFINITY) return b;
  if (b.max == -INFINITY) return a;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// One element into a running (max, sum): a single exp per element.
__device__ __forceinline__ void accumulate(MaxSum& ms, float z) {
  if (z > ms.max) {
    ms.sum = ms.sum * __expf(ms.max - z) + 1.f;  // exp(-inf) = 0 on the first element
    ms.max = z;
  } else {
    ms.sum += __expf(z - ms.max);
  }
}

__device__ __forceinline__ float capped(float x, float cap) { return cap > 0.f ? cap * tanhf(x / cap) : x; }

// A row's loss from its log-sum-exp, its (capped) target logit and the sum of its (capped) logits:
// -(1 - eps) z_t - (eps / V) sum_j z_j + lse; NaN for a target outside the vocabulary, 0 ignored.
__device__ __forceinline__ float row_loss(float lse, float target_logit, float row_total, float eps, float smooth,
                                          bool ignored, bool invalid) {
  if (invalid) return NAN;
  if (ignored) return 0.f;
  return lse - (1.f - eps) * target_logit - smooth * row_total;
}

// d loss / d x_j for the raw logit x_j (before the cap), times the row's scale (0 for an ignored or
// invalid row): softmax_j - eps / V - (1 - eps) [j == target], through the cap's 1 - tanh^2.
__device__ __forceinline__ float logit_grad(float x, int64_t j, int64_t target, float lse, float eps, float smooth,
                                            float cap, float scale) {
  if (scale == 0.f) return 0.f;
  const float z = capped(x, cap);
  float g = __expf(z - lse) - smooth - (j == target ? 1.f - eps : 0.f);
  if (cap > 0.f) g *= 1.f - (z / cap) * (z / cap);
  return g * scale;
}

// Block-wide reduction of (max, sum) and a plain float sum over kBlockThreads threads; every
// thread gets the results.
template <int kBlockThreads>
__device__ void block_reduce(MaxSum& ms, float& total) {
  __shared__ MaxSum shared_ms[kBlockThreads / 32];
  __shared__ float shared_total[kBlockThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffff, ms.max, offset), __shfl_xor_sync(0xffffffff, ms.sum, offset)};
    ms = merge(ms, other);
    total += __shfl_xor_sync(0xffffffff, total, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_ms[warp] = ms;
    shared_total[warp] = total;
  }
  __syncthreads();
  if (warp == 0) {
    ms = lane < kBlockThreads / 32 ? shared_ms[lane] : MaxSum{-INFINITY, 0.f};
    total = lane < kBlockThreads / 32 ? shared_total[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) {
      MaxSum other{__shfl_xor_sync(0xffffffff, ms.max, offset), __shfl_xor_sync(0xffffffff, ms.sum, offset)};
      ms = merge(ms, other);
      total += __shfl_xor_sync(0xffffffff, total, offset);
    }
    if (lane == 0) {
      shared_ms[0] = ms;
      shared_total[0] = total;
    }
  }
  __syncthreads();
  ms = shared_ms[0];
  total = shared_total[0];
}

template <typename T, int V>  // V elements per load: 16 bytes, or 1 where rows are not aligned
__global__ void __launch_bounds__(kThreads) cross_entropy_rows_kernel(CrossEntropyRowsParams p) {
  const int64_t row = blockIdx.x;
  T* logits = static_cast<T*>(p.logits) + row * p.ld;
  const int64_t target = p.targets[row];
  const bool ignored = target == p.ignore_index;
  const bool invalid = !ignored && (target < 0 || target >= p.vocab);
  const float cap = p.softcap;
  const int64_t vectors = p.vocab / V;

  MaxSum ms{-INFINITY, 0.f};
  float total = 0.f;
  if (!ignored) {
    for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
      T chunk[V];
      load_chunk<T, V>(logits, v, chunk);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float z = capped(to_float(chunk[i]), cap);
        total += z;
        accumulate(ms, z);
      }
    }
    for (int64_t j = vectors * V + threadIdx.x; j < p.vocab; j += kThreads) {  // tail
      const float z = capped(to_float(logits[j]), cap);
      total += z;
      accumulate(ms, z);
    }
  }
  block_reduce<kThreads>(ms, total);
  const float lse = ms.max + __logf(ms.sum);
  const float eps = p.label_smoothing;
  const float smooth = eps / static_cast<float>(p.vocab);
  if (threadIdx.x == 0) {
    const float zt = ignored || invalid ? 0.f : capped(to_float(logits[target]), cap);
    p.loss[row] = row_loss(lse, zt, total, eps, smooth, ignored, invalid);
  }
  if (p.grad_scale == nullptr) return;
  __syncthreads();  // thread 0 has read logits[target] before anyone overwrites it
  const float scale = (ignored || invalid) ? 0.f : *p.grad_scale;
  auto grad_of = [&](float x, int64_t j) -> float { return logit_grad(x, j, target, lse, eps, smooth, cap, scale); };
  for (int64_t v = threadIdx.x; v < vectors; v += kThreads) {
    T chunk[V];
    load_chunk<T, V>(logits, v, chunk);
#pragma unroll
    for (int i = 0; i < V; ++i) chunk[i] = from_float<T>(grad_of(to_float(chunk[i]), v * V + i));
    store_chunk<T, V>(logits, v, chunk);
  }
  for (int64_t j = vectors * V + threadIdx.x; j < p.vocab; j += kThreads)
    logits[j] = from_float<T>(grad_of(to_float(logits[j]), j));
}

constexpr int kClusterThreads = 1024;
constexpr int64_t kClusterSliceBytes = 200 * 1024;  // a block's share of a row in shared memory
constexpr int kMaxCluster = 8;                     // the portable cluster size

// One block's summary of its slice, read by the cluster's other blocks.
struct SliceStats {
  MaxSum ms;
  float total;
  float target;  // the capped target logit, in the block whose slice holds it
};

// One row per cluster of `ranks` blocks (blockIdx.x / ranks); block rank r holds vectors
// [r * slice_vectors, (r + 1) * slice_vectors) of it in shared memory. Rows of whole vectors only.
template <typename T>
__global__ void __launch_bounds__(kClusterThreads, 1)
    cross_entropy_rows_cluster_kernel(CrossEntropyRowsParams p, int64_t slice_vectors) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  constexpr int V = kVec<T>;
  constexpr int kClusterLoads = 4;  // 16-byte loads a thread has in flight
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) unsigned char slice_bytes[];
  T* slice = reinterpret_cast<T*>(slice_bytes);
  __shared__ SliceStats stats;
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / ranks;
  T* logits = static_cast<T*>(p.logits) + row * p.ld;
  const int64_t target = p.targets[row];
  const bool ignored = target == p.ignore_index;
  const bool invalid = !ignored && (target < 0 || target >= p.vocab);
  const float cap = p.softcap;
  const int64_t vectors = p.vocab / V;
  const int64_t first = rank * slice_vectors;
  const int64_t count = first < vectors ? (vectors - first < slice_vectors ? vectors - first : slice_vectors) : 0;

  MaxSum ms{-INFINITY, 0.f};
  float total = 0.f;
  if (!ignored) {
    // kClusterLoads vectors a thread loaded before any is used or stored (a store to shared memory
    // through a generic pointer would keep later loads behind it)
    for (int64_t base = threadIdx.x; base < count; base += kClusterLoads * kClusterThreads) {
      T chunk[kClusterLoads][V];
#pragma unroll
      for (int k = 0; k < kClusterLoads; ++k) {
        const int64_t v = base + k * kClusterThreads;
        if (v < count) load_chunk<T, V>(logits, first + v, chunk[k]);
      }
#pragma unroll
      for (int k = 0; k < kClusterLoads; ++k) {
        const int64_t v = base + k * kClusterThreads;
        if (v >= count) continue;
        store_chunk<T, V>(slice, v, chunk[k]);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float z = capped(to_float(chunk[k][i]), cap);
          total += z;
          accumulate(ms, z);
        }
      }
    }
  }
  block_reduce<kClusterThreads>(ms, total);
  if (threadIdx.x == 0) {
    const int64_t at = target - first * V;  // the target's place in this slice
    const bool holds_target = !ignored && !invalid && at >= 0 && at < count * V;
    stats = {ms, total, holds_target ? capped(to_float(slice[at]), cap) : 0.f};
  }
  cluster.sync();  // every block's stats written
  MaxSum row_ms{-INFINITY, 0.f};
  float row_total = 0.f, target_logit = 0.f;
  for (int r = 0; r < ranks; ++r) {  // rank order: the same sums in every block and every run
    const SliceStats* theirs = cluster.map_shared_rank(&stats, r);
    row_ms = merge(row_ms, theirs->ms);
    row_total += theirs->total;
    if (!ignored && !invalid && target / V >= r * slice_vectors && target / V < (r + 1) * slice_vectors)
      target_logit = theirs->target;
  }
  cluster.sync();  // no block leaves, taking its shared memory, while another still reads it
  const float lse = row_ms.max + __logf(row_ms.sum);
  const float eps = p.label_smoothing;
  const float smooth = eps / static_cast<float>(p.vocab);
  if (rank == 0 && threadIdx.x == 0) p.loss[row] = row_loss(lse, target_logit, row_total, eps, smooth, ignored, invalid);
  if (p.grad_scale == nullptr) return;
  const float scale = (ignored || invalid) ? 0.f : *p.grad_scale;
  for (int64_t v = threadIdx.x; v < count; v += kClusterThreads) {
    T chunk[V];
    if (scale == 0.f) {
#pragma unroll
      for (int i = 0; i < V; ++i) chunk[i] = from_float<T>(0.f);
    } else {
      load_chunk<T, V>(slice, v, chunk);
#pragma unroll
      for (int i = 0; i < V; ++i)
        chunk[i] = from_float<T>(logit_grad(to_float(chunk[i]), (first + v) * V + i, target, lse, eps, smooth, cap, scale));
    }
    store_chunk<T, V>(logits, first + v, chunk);
  }
#endif
}

// The cluster kernel's launch where HASTEN_CE_CLUSTER=1 asks for it and it applies (sm_90, rows of
// whole 16-byte vectors, at most kMaxCluster slices, a cluster that fits the device); returns
// false to let the caller launch the one-block kernel.
template <typename T>
bool launch_cluster(const CrossEntropyRowsParams& p, cudaStream_t stream, cudaError_t* result) {
  const char* asked = std::getenv("HASTEN_CE_CLUSTER");
  if (asked == nullptr || std::strcmp(asked, "1") != 0) return false;
  constexpr int V = kVec<T>;
  if (p.vocab % V != 0 || p.ld % V != 0 || !aligned16(p.logits)) return false;
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess || major < 9)
    return false;
  const int64_t vectors = p.vocab / V;
  const int64_t per_block = kClusterSliceBytes / 16;
  const int64_t ranks = (vectors + per_block - 1) / per_block;
  if (ranks > kMaxCluster || p.rows * ranks > 0x7fffffff) return false;
  const int64_t slice_vectors = (vectors + ranks - 1) / ranks;
  const size_t shared = static_cast<size_t>(slice_vectors) * 16;
  auto kernel = cross_entropy_rows_cluster_kernel<T>;
  cudaFuncAttributes compiled{};
  // the kernel's body exists only in sm_90 code: a build without it (or PTX of an older arch run
  // through the JIT) would launch an empty kernel
  if (cudaFuncGetAttributes(&compiled, kernel) != cudaSuccess || compiled.binaryVersion < 90) {
    cudaGetLastError();
    return false;
  }
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)) !=
      cudaSuccess) {
    cudaGetLastError();  // clear it: the one-block kernel runs instead
    return false;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.rows * ranks));
  config.blockDim = dim3(kClusterThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(ranks);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess || clusters < 1) {
    cudaGetLastError();
    return false;
  }
  *result = cudaLaunchKernelEx(&config, kernel, p, slice_vectors);
  return true;
}

}  // namespace

cudaError_t launch_cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > 0x7fffffff) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    cudaError_t clustered = cudaSuccess;
    if (launch_cluster<T>(p, stream, &clustered)) return clustered;
    constexpr int kV = kVec<T>;
    const bool vector_ok = p.ld % kV == 0 && aligned16(p.logits);
    if (vector_ok) {
      cross_entropy_rows_kernel<T, kV><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    } else {
      cross_entropy_rows_kernel<T, 1><<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
