// Cross-entropy over rows of LM-head logits, gradient written in place (see cross_entropy.cuh).
// Two passes over a row: an online max/sum-exp, then the gradient. 16-byte vector loads when the
// row stride and base allow it (vocab sizes like 151936 and 128256 do); one element per load
// otherwise (the same kernel with V = 1).
#include <cfloat>
#include <cmath>

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

// Block-wide reduction of (max, sum) and a plain float sum; every thread gets the results.
__device__ void block_reduce(MaxSum& ms, float& total) {
  __shared__ MaxSum shared_ms[kThreads / 32];
  __shared__ float shared_total[kThreads / 32];
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
    ms = lane < kThreads / 32 ? shared_ms[lane] : MaxSum{-INFINITY, 0.f};
    total = lane < kThreads / 32 ? shared_total[lane] : 0.f;
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
  block_reduce(ms, total);
  const float lse = ms.max + __logf(ms.sum);
  const float eps = p.label_smoothing;
  const float smooth = eps / static_cast<float>(p.vocab);
  if (threadIdx.x == 0) {
    float loss = 0.f;
    if (invalid) {
      loss = NAN;
    } else if (!ignored) {
      const float zt = capped(to_float(logits[target]), cap);
      loss = lse - (1.f - eps) * zt - smooth * total;
    }
    p.loss[row] = loss;
  }
  if (p.grad_scale == nullptr) return;
  __syncthreads();  // thread 0 has read logits[target] before anyone overwrites it
  const float scale = (ignored || invalid) ? 0.f : *p.grad_scale;
  auto grad_of = [&](float x, int64_t j) -> float {
    if (scale == 0.f) return 0.f;
    const float z = capped(x, cap);
    float g = __expf(z - lse) - smooth - (j == target ? 1.f - eps : 0.f);
    if (cap > 0.f) g *= 1.f - (z / cap) * (z / cap);
    return g * scale;
  };
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

}  // namespace

cudaError_t launch_cross_entropy_rows(const CrossEntropyRowsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > 0x7fffffff) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
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
