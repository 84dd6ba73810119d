// Gated MLP activations (SwiGLU, GeGLU-tanh), forward and backward, over rows of gate and up at a
// common row stride (swiglu.cuh): one pass reads both and writes the activation, or reads them
// with the incoming gradient and writes both gradients. float math. The gate's activation is a
// template parameter (one kernel body for every activation, no branch per element). Rows sit on
// blockIdx.y (looping past the grid's limit) and columns on x in 16-byte chunks where every row
// is aligned for them (one element otherwise), so no thread divides an index.
#include "dtype_utils.cuh"
#include "expert_rows.cuh"
#include "gate_activation_math.cuh"
#include "swiglu.cuh"
#include "warp_sums.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 128;

template <typename T, int V, GateActivation A>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(SwigluParams p) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk in the row
  if (v * V >= p.inner) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    T g[V], u[V];
    load_chunk<T, V>(static_cast<const T*>(p.gate) + r * p.in_stride, v, g);
    load_chunk<T, V>(static_cast<const T*>(p.up) + r * p.in_stride, v, u);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      g[i] = from_float<T>(gate_activation<A>(to_float(g[i])).value * to_float(u[i]));
    }
    store_chunk<T, V>(static_cast<T*>(p.out) + r * p.inner, v, g);
  }
}

template <typename T, int V, GateActivation A>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(SwigluParams p) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v * V >= p.inner) return;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    T g[V], u[V], d[V];
    load_chunk<T, V>(static_cast<const T*>(p.gate) + r * p.in_stride, v, g);
    load_chunk<T, V>(static_cast<const T*>(p.up) + r * p.in_stride, v, u);
    load_chunk<T, V>(static_cast<const T*>(p.grad_act) + r * p.inner, v, d);
#pragma unroll
    for (int i = 0; i < V; ++i) gated_backward_element<A>(g[i], u[i], d[i]);
    store_chunk<T, V>(static_cast<T*>(p.out) + r * p.out_stride, v, g);
    store_chunk<T, V>(static_cast<T*>(p.out_up) + r * p.out_stride, v, u);
  }
}

// 16-byte chunks when every row of every tensor starts on a 16-byte boundary.
template <typename T>
bool vectors_fit(const SwigluParams& p, bool backward) {
  constexpr int kV = kVec<T>;
  const bool strides = p.inner % kV == 0 && p.in_stride % kV == 0 && (!backward || p.out_stride % kV == 0);
  const bool bases = aligned16(p.gate) && aligned16(p.up) && aligned16(p.out) &&
                     (!backward || (aligned16(p.grad_act) && aligned16(p.out_up)));
  return strides && bases;
}

// Threads along a row's `elements` in chunks of `elements_per_chunk` (x), rows on y up to the grid's
// limit (the kernels loop past it).
dim3 grid_for(int64_t elements, int64_t rows, int elements_per_chunk) {
  const int64_t chunks = (elements + elements_per_chunk - 1) / elements_per_chunk;
  return dim3(static_cast<unsigned>((chunks + kThreads - 1) / kThreads),
              static_cast<unsigned>(rows < 65535 ? rows : 65535));
}

template <typename T, GateActivation A>
cudaError_t launch_with(const SwigluParams& p, bool backward, cudaStream_t stream) {
  const bool vectors = vectors_fit<T>(p, backward);
  const dim3 grid = grid_for(p.inner, p.rows, vectors ? kVec<T> : 1);
  if (backward) {
    if (vectors) swiglu_backward_kernel<T, kVec<T>, A><<<grid, kThreads, 0, stream>>>(p);
    else swiglu_backward_kernel<T, 1, A><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (vectors) swiglu_forward_kernel<T, kVec<T>, A><<<grid, kThreads, 0, stream>>>(p);
    else swiglu_forward_kernel<T, 1, A><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch(const SwigluParams& p, bool backward, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    switch (p.activation) {
      case GateActivation::kSilu: return launch_with<T, GateActivation::kSilu>(p, backward, stream);
      case GateActivation::kGeluTanh: return launch_with<T, GateActivation::kGeluTanh>(p, backward, stream);
    }
    return cudaErrorInvalidValue;
  });
}

// N consecutive elements starting at element chunk * N: one 16- or 8-byte access where the launch
// checked the alignment for it (the vector path), else element by element.
template <typename T, int N, bool kWide>
__device__ __forceinline__ void load_elements(const T* row, int64_t chunk, T (&out)[N]) {
  if constexpr (kWide && N * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(out) = reinterpret_cast<const uint4*>(row)[chunk];
  } else if constexpr (kWide && N * sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(out) = reinterpret_cast<const uint2*>(row)[chunk];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = row[chunk * N + i];
  }
}

template <typename T, int N, bool kWide>
__device__ __forceinline__ void store_elements(T* row, int64_t chunk, const T (&in)[N]) {
  if constexpr (kWide && N * sizeof(T) == 16) {
    reinterpret_cast<uint4*>(row)[chunk] = *reinterpret_cast<const uint4*>(in);
  } else if constexpr (kWide && N * sizeof(T) == 8) {
    reinterpret_cast<uint2*>(row)[chunk] = *reinterpret_cast<const uint2*>(in);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) row[chunk * N + i] = in[i];
  }
}

// gpt-oss's clamped SwiGLU (swiglu.cuh): a thread takes V consecutive elements of a gate_up row,
// V / 2 (gate, up) pairs, and writes V / 2 activations (forward) or V gradients in the same
// interleaved places (backward). expf, not __expf: float32 runs must match torch's sigmoid to
// rounding (the accelerate-time check compares them).
struct ClampedGate {
  float g, u, s, glu;  // min(gate, limit), clamp(up), sigmoid(alpha g), g * s
  bool gate_passes, up_passes;
};

__device__ __forceinline__ ClampedGate clamped_gate(float gate, float up, float alpha, float limit) {
  ClampedGate c;
  c.gate_passes = gate <= limit;
  c.up_passes = up >= -limit && up <= limit;
  c.g = fminf(gate, limit);
  c.u = fminf(fmaxf(up, -limit), limit);
  c.s = 1.0f / (1.0f + expf(-(c.g * alpha)));
  c.glu = c.g * c.s;
  return c;
}

// Rows per thread in the clamped kernels. One row per block (gpt-oss-20b: 5,760 values, six
// blocks of 128 threads, a 16-byte load each) left each thread one load in flight behind a chain
// of dependent ones (the binary search for the row's expert, then its bias): on an H100 at 7652501
// the forward moved its 1.13 GB in 0.70 ms (1.6 TB/s; the plain SwiGLU runs near 4 TB/s on an
// H200). Four consecutive rows per thread put four loads in flight, and their experts come from one
// search and a forward walk (sorted rows: usually the same expert).
constexpr int kClampedRows = 4;

// The experts of rows r0 .. r0 + kClampedRows - 1 (sorted rows: non-decreasing), where the params
// carry a bias.
__device__ __forceinline__ void experts_of_rows(const ClampedSwigluParams& p, int64_t r0,
                                                int64_t (&expert)[kClampedRows]) {
  int64_t e = expert_of_row(p.group_ends, p.experts, r0);
#pragma unroll
  for (int i = 0; i < kClampedRows; ++i) {
    while (e < p.experts - 1 && p.group_ends[e] <= r0 + i) ++e;
    expert[i] = e;
  }
}

// gate_up chunk v of a row plus its expert's bias, rounded to T (the model adds the bias in its
// dtype).
template <typename T, int V, bool kWide>
__device__ __forceinline__ void add_row_bias(const ClampedSwigluParams& p, int64_t expert, int64_t v, T (&x)[V]) {
  T b[V];
  load_elements<T, V, kWide>(static_cast<const T*>(p.bias) + expert * 2 * p.inner, v, b);
#pragma unroll
  for (int i = 0; i < V; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(b[i]));
}

// Chunk v of rows r0 .. r0 + kClampedRows - 1 plus each row's expert bias, where the params carry one.
template <typename T, int V, bool kWide>
__device__ __forceinline__ void add_rows_bias(const ClampedSwigluParams& p, int64_t r0, int64_t v,
                                              T (&x)[kClampedRows][V]) {
  if (p.bias == nullptr) return;
  int64_t expert[kClampedRows];
  experts_of_rows(p, r0, expert);
#pragma unroll
  for (int k = 0; k < kClampedRows; ++k) add_row_bias<T, V, kWide>(p, expert[k], v, x[k]);
}

template <typename T, int V, bool kWide>
__global__ void __launch_bounds__(kThreads) clamped_swiglu_forward_kernel(ClampedSwigluParams p) {
  static_assert(V % 2 == 0, "whole (gate, up) pairs per thread");
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk of V in the row
  if (v * V >= 2 * p.inner) return;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kClampedRows; r0 < p.rows;
       r0 += static_cast<int64_t>(gridDim.y) * kClampedRows) {
    T x[kClampedRows][V];
#pragma unroll
    for (int k = 0; k < kClampedRows; ++k) {  // every load issued before any is used
      if (r0 + k < p.rows) load_elements<T, V, kWide>(static_cast<const T*>(p.gate_up) + (r0 + k) * 2 * p.inner, v, x[k]);
    }
    add_rows_bias<T, V, kWide>(p, r0, v, x);
#pragma unroll
    for (int k = 0; k < kClampedRows; ++k) {
      if (r0 + k >= p.rows) break;
      T act[V / 2];
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        const ClampedGate c = clamped_gate(to_float(x[k][2 * i]), to_float(x[k][2 * i + 1]), p.alpha, p.limit);
        act[i] = from_float<T>((c.u + 1.0f) * c.glu);
      }
      store_elements<T, V / 2, kWide>(static_cast<T*>(p.out) + (r0 + k) * p.inner, v, act);
    }
  }
}

template <typename T, int V, bool kWide>
__global__ void __launch_bounds__(kThreads) clamped_swiglu_backward_kernel(ClampedSwigluParams p) {
  static_assert(V % 2 == 0, "whole (gate, up) pairs per thread");
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v * V >= 2 * p.inner) return;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.y) * kClampedRows; r0 < p.rows;
       r0 += static_cast<int64_t>(gridDim.y) * kClampedRows) {
    T x[kClampedRows][V], d[kClampedRows][V / 2];
#pragma unroll
    for (int k = 0; k < kClampedRows; ++k) {
      if (r0 + k >= p.rows) break;
      load_elements<T, V, kWide>(static_cast<const T*>(p.gate_up) + (r0 + k) * 2 * p.inner, v, x[k]);
      load_elements<T, V / 2, kWide>(static_cast<const T*>(p.grad_act) + (r0 + k) * p.inner, v, d[k]);
    }
    add_rows_bias<T, V, kWide>(p, r0, v, x);
#pragma unroll
    for (int k = 0; k < kClampedRows; ++k) {
      if (r0 + k >= p.rows) break;
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        const ClampedGate c = clamped_gate(to_float(x[k][2 * i]), to_float(x[k][2 * i + 1]), p.alpha, p.limit);
        const float df = to_float(d[k][i]);
        const float slope = c.s + c.g * c.s * (1.0f - c.s) * p.alpha;  // d(g sigmoid(alpha g)) / dg
        x[k][2 * i] = from_float<T>(c.gate_passes ? df * (c.u + 1.0f) * slope : 0.0f);
        x[k][2 * i + 1] = from_float<T>(c.up_passes ? df * c.glu : 0.0f);
      }
      store_elements<T, V, kWide>(static_cast<T*>(p.out) + (r0 + k) * 2 * p.inner, v, x[k]);
    }
  }
}

// 16-byte chunks of gate_up (and 8-byte ones of act / d_act) where every row is aligned for them;
// two elements (one pair) a thread otherwise.
template <typename T>
bool clamped_vectors_fit(const ClampedSwigluParams& p, bool backward) {
  constexpr int kV = kVec<T>;
  return (2 * p.inner) % kV == 0 && p.inner % (kV / 2) == 0 && aligned16(p.gate_up) && aligned16(p.out) &&
         (!backward || aligned16(p.grad_act)) && (p.bias == nullptr || aligned16(p.bias));
}

template <typename T>
cudaError_t launch_clamped_with(const ClampedSwigluParams& p, bool backward, cudaStream_t stream) {
  const bool vectors = clamped_vectors_fit<T>(p, backward);
  const dim3 grid = grid_for(2 * p.inner, (p.rows + kClampedRows - 1) / kClampedRows, vectors ? kVec<T> : 2);
  if (backward) {
    if (vectors) clamped_swiglu_backward_kernel<T, kVec<T>, true><<<grid, kThreads, 0, stream>>>(p);
    else clamped_swiglu_backward_kernel<T, 2, false><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (vectors) clamped_swiglu_forward_kernel<T, kVec<T>, true><<<grid, kThreads, 0, stream>>>(p);
    else clamped_swiglu_forward_kernel<T, 2, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_clamped(const ClampedSwigluParams& p, bool backward, cudaStream_t stream) {
  if (p.rows * p.inner == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, { return launch_clamped_with<T>(p, backward, stream); });
}

// The MoE experts' SwiGLU with the router's weights folded in (swiglu.cuh). Forward: the plain
// kernel's layout (chunks of a row on x, rows on y), each row's weight read through the permutation.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads) moe_weighted_swiglu_forward_kernel(MoeWeightedSwigluParams p) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // chunk in the row
  if (v * V >= p.inner) return;
  const int64_t valid = *p.valid_rows;
  for (int64_t r = blockIdx.y; r < p.rows; r += gridDim.y) {
    T act[V];
    if (r < valid) {
      const T* row = static_cast<const T*>(p.gate_up) + r * 2 * p.inner;
      T g[V], u[V];
      load_chunk<T, V>(row, v, g);
      load_chunk<T, V>(row + p.inner, v, u);
      const float w = to_float(static_cast<const T*>(p.weights)[p.permutation[r]]);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        act[i] = from_float<T>(w * (gate_activation<GateActivation::kSilu>(to_float(g[i])).value * to_float(u[i])));
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) act[i] = from_float<T>(0.0f);
    }
    store_chunk<T, V>(static_cast<T*>(p.out) + r * p.inner, v, act);
  }
}

// Backward: one warp per row (the weight's gradient is a sum over the row), lanes over its chunks;
// the lanes' partial sums meet in a fixed xor order, so the result is the same on every run.
constexpr int kRowsPerBlock = kThreads / 32;

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) moe_weighted_swiglu_backward_kernel(MoeWeightedSwigluParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t chunks = p.inner / V;  // the launch picks V dividing I
  const int64_t valid = *p.valid_rows;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; r < p.rows;
       r += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    T* out_row = static_cast<T*>(p.out) + r * 2 * p.inner;
    const int32_t slot = p.permutation[r];
    if (r >= valid) {  // a dropped slot: zero gradients
      T zero[V];
#pragma unroll
      for (int i = 0; i < V; ++i) zero[i] = from_float<T>(0.0f);
      for (int64_t v = lane; v < chunks; v += 32) {
        store_chunk<T, V>(out_row, v, zero);
        store_chunk<T, V>(out_row + p.inner, v, zero);
      }
      if (lane == 0) static_cast<T*>(p.grad_weights)[slot] = from_float<T>(0.0f);
      continue;
    }
    const T* row = static_cast<const T*>(p.gate_up) + r * 2 * p.inner;
    const T* grad_row = static_cast<const T*>(p.grad_act) + r * p.inner;
    const float w = to_float(static_cast<const T*>(p.weights)[slot]);
    float dot = 0.0f;
    for (int64_t v = lane; v < chunks; v += 32) {
      T g[V], u[V], d[V];
      load_chunk<T, V>(row, v, g);
      load_chunk<T, V>(row + p.inner, v, u);
      load_chunk<T, V>(grad_row, v, d);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const GateValue f = gate_activation<GateActivation::kSilu>(to_float(g[i]));
        const float uf = to_float(u[i]), df = to_float(d[i]);
        dot += f.value * uf * df;
        const float ds = w * df;  // d of silu(gate) * up
        g[i] = from_float<T>(ds * uf * f.slope);
        u[i] = from_float<T>(ds * f.value);
      }
      store_chunk<T, V>(out_row, v, g);
      store_chunk<T, V>(out_row + p.inner, v, u);
    }
    dot = group_sum(dot, 32);
    if (lane == 0) static_cast<T*>(p.grad_weights)[slot] = from_float<T>(dot);
  }
}

template <typename T>
cudaError_t launch_weighted_with(const MoeWeightedSwigluParams& p, bool backward, cudaStream_t stream) {
  constexpr int kV = kVec<T>;
  const bool vectors = p.inner % kV == 0 && aligned16(p.gate_up) && aligned16(p.out) &&
                       (!backward || aligned16(p.grad_act));
  if (backward) {
    const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const unsigned grid = static_cast<unsigned>(blocks < (int64_t{1} << 30) ? blocks : (int64_t{1} << 30));
    if (vectors) moe_weighted_swiglu_backward_kernel<T, kV><<<grid, kThreads, 0, stream>>>(p);
    else moe_weighted_swiglu_backward_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  } else {
    if (p.inner == 0) return cudaSuccess;  // an empty act; the backward still writes each d_w (0)
    const dim3 grid = grid_for(p.inner, p.rows, vectors ? kV : 1);
    if (vectors) moe_weighted_swiglu_forward_kernel<T, kV><<<grid, kThreads, 0, stream>>>(p);
    else moe_weighted_swiglu_forward_kernel<T, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_weighted(const MoeWeightedSwigluParams& p, bool backward, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return HASTEN_DISPATCH_ELEMENT(p.type, { return launch_weighted_with<T>(p, backward, stream); });
}

}  // namespace

cudaError_t launch_clamped_swiglu_forward(const ClampedSwigluParams& p, cudaStream_t stream) {
  return launch_clamped(p, false, stream);
}

cudaError_t launch_clamped_swiglu_backward(const ClampedSwigluParams& p, cudaStream_t stream) {
  return launch_clamped(p, true, stream);
}

cudaError_t launch_moe_weighted_swiglu_forward(const MoeWeightedSwigluParams& p, cudaStream_t stream) {
  return launch_weighted(p, false, stream);
}

cudaError_t launch_moe_weighted_swiglu_backward(const MoeWeightedSwigluParams& p, cudaStream_t stream) {
  return launch_weighted(p, true, stream);
}

cudaError_t launch_swiglu_forward(const SwigluParams& p, cudaStream_t stream) { return launch(p, false, stream); }

cudaError_t launch_swiglu_backward(const SwigluParams& p, cudaStream_t stream) { return launch(p, true, stream); }

}  // namespace kernels
}  // namespace hasten
