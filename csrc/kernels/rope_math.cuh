// The rotation of one rotary pair, shared by hasten::rope's kernel (rope_kernel.cu) and the fused
// head norm + rotary kernel (rms_norm_rope_kernel.cu), so that both round the same float
// expressions (rope.cuh gives the map). A pair is (a, b) = (x_lo, x_hi):
//   forward   lo' = a cos_lo - b sin_lo      hi' = b cos_hi + a sin_hi
//   backward  lo' = a cos_lo + b sin_hi      hi' = b cos_hi - a sin_lo
// so a lane that holds only one side of the pair needs its own cos and, backward, the other
// side's sin.
#pragma once

#include "dtype_utils.cuh"

namespace hasten {
namespace kernels {

// lo' of a pair; `sin`: sin_lo forward, sin_hi backward.
__device__ __forceinline__ float rotated_lo(float a, float b, float cos_lo, float sin, bool backward) {
  return backward ? a * cos_lo + b * sin : a * cos_lo - b * sin;
}

// hi' of a pair; `sin`: sin_hi forward, sin_lo backward.
__device__ __forceinline__ float rotated_hi(float a, float b, float cos_hi, float sin, bool backward) {
  return backward ? b * cos_hi - a * sin : b * cos_hi + a * sin;
}

// One pair (x_lo, x_hi) in place, with cos and sin at feature indices lo and hi.
template <typename T, typename C>
__device__ __forceinline__ void rotate_pair(T& x_lo, T& x_hi, C cos_lo, C cos_hi, C sin_lo, C sin_hi,
                                            bool backward) {
  const float a = to_float(x_lo), b = to_float(x_hi);
  x_lo = from_float<T>(rotated_lo(a, b, to_float(cos_lo), to_float(backward ? sin_hi : sin_lo), backward));
  x_hi = from_float<T>(rotated_hi(a, b, to_float(cos_hi), to_float(backward ? sin_lo : sin_hi), backward));
}

// N consecutive cos (or sin) values from element `start` of a position's row, kept in their own
// type (bf16 angles: 4 registers for 8): 16-byte loads when kVectors (the host checked that the
// row and `start` are 16-byte aligned and N values fill whole vectors), else N scalar loads.
template <typename C, int N, bool kVectors>
__device__ __forceinline__ void load_angles(const C* row, int64_t start, C (&out)[N]) {
  if constexpr (kVectors) {
    constexpr int kPer = 16 / sizeof(C);
    static_assert(N % kPer == 0, "whole 16-byte vectors");
#pragma unroll
    for (int c = 0; c < N / kPer; ++c) {
      C chunk[kPer];
      load_chunk<C, kPer>(row + start, c, chunk);
#pragma unroll
      for (int i = 0; i < kPer; ++i) out[c * kPer + i] = chunk[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = row[start + i];
  }
}

}  // namespace kernels
}  // namespace hasten
