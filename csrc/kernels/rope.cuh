// Torch-free, host-includable interface of the rotary-embedding kernel (transformers'
// rotate_half convention). x (B, heads, L, D) with any strides but a unit stride along D;
// cos, sin (B or broadcast, L, D) with a unit stride along D; h = D / 2. For j < h:
//   forward   y_j = x_j cos_j - x_{j+h} sin_j        y_{j+h} = x_{j+h} cos_{j+h} + x_j sin_{j+h}
//   backward  g_j = d_j cos_j + d_{j+h} sin_{j+h}    g_{j+h} = d_{j+h} cos_{j+h} - d_j sin_j
// (the transpose of the forward map; cos and sin carry no gradient).
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
  int64_t batch, heads, length, dim;
  int64_t x_stride[3];    // batch, head, position (elements)
  int64_t out_stride[3];
  int64_t cs_stride[2];   // batch (0 when broadcast), position
  bool backward;
  ElementType type;       // of x and out
  ElementType cs_type;    // of cos and sin
};

cudaError_t launch_rope(const RopeParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
