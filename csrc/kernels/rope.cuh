// Torch-free, host-includable interface of the rotary-embedding kernel. x (B, heads, L, D) with
// any strides but a unit stride along D; cos, sin (B or broadcast, L, R) with a unit stride along
// R, R even and 0 < R <= D. The first R features of each row rotate in pairs (lo, hi); features
// R..D-1 pass through unchanged (partial rotary, R < D), forward and backward. For j < R/2:
//   interleaved = false (transformers' rotate_half)         lo = j,   hi = j + R/2
//   interleaved = true  (GLM / Cohere, x[::2] and x[1::2])  lo = 2j,  hi = 2j + 1
//   forward   y_lo = x_lo cos_lo - x_hi sin_lo        y_hi = x_hi cos_hi + x_lo sin_hi
//   backward  g_lo = d_lo cos_lo + d_hi sin_hi        g_hi = d_hi cos_hi - d_lo sin_lo
// (the transpose of the forward map; cos and sin are read per element, carry no gradient).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

struct RopeParams {
  const void* x;
  void* out;
  const void* cos;
  const void* sin;
  int64_t batch, heads, length, dim;  // dim = D, head_dim
  int64_t rotary_dim;                 // R: the first R features rotate, the others are copied
  int64_t x_stride[3];    // batch, head, position (elements)
  int64_t out_stride[3];
  int64_t cs_stride[2];   // batch (0 when broadcast), position; cos and sin share them
  bool backward;
  bool interleaved;       // pairs (2j, 2j + 1) instead of (j, j + R/2)
  ElementType type;       // of x and out
  ElementType cs_type;    // of cos and sin
};

cudaError_t launch_rope(const RopeParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
