// Torch-free, host-includable interface of the RMSNorm kernels. Rows (R, H) contiguous:
//   forward   rstd = 1 / sqrt(mean(x^2) + eps)   (float32, kept for backward)
//             y = (weight + offset) * round_to_T(x * rstd)   (transformers' Llama/Qwen order:
//             the normalised value is cast to the input dtype before the weight multiplies it)
//   backward  n = x * rstd, wg = (weight + offset) * grad_y
//             grad_x = rstd * (wg - n * mean(wg * n))
//             grad_weight_partial[b, :] = sum of grad_y * round_to_T(n) over the rows block b
//             handles, every column written (the caller sums the partials over blocks: float
//             accumulation, no global atomics). Shared memory holds one float per column: hidden
//             above about 57k columns is refused (cudaErrorInvalidValue from the attribute call).
// The residual add fused in (hasten::add_rms_norm, a decoder's `h = residual + x; norm(h)`):
//   forward   with `residual`: s = round_to_T(x + residual) is written to `sum` and normalised
//             in place of x (the same value the separate add gives)
//   backward  with `grad_add`: grad_x = rstd * (...) + grad_add, rounded once (the gradient that
//             reaches s from its other use, the residual stream, summed in float32)
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

struct RmsNormParams {
  const void* x;
  const void* weight;  // (H,), the element type of x
  const void* grad_y;  // backward only
  void* y;             // forward: y; backward: grad_x
  float* rstd;         // (R,)
  const void* residual = nullptr;  // forward: added to x before the norm (R, H); nullptr: none
  void* sum = nullptr;             // forward with residual: x + residual (R, H)
  const void* grad_add = nullptr;  // backward: added to grad_x (R, H); nullptr: none
  float* grad_weight_partial;  // backward: (blocks, H), written whole; nullptr: no weight gradient
  int64_t rows, hidden;
  float eps, offset;
  ElementType type;
};

// Blocks for the backward launch (rows per block vary): the first dim of grad_weight_partial.
int rms_norm_backward_blocks(int64_t rows, int device);
cudaError_t launch_rms_norm_forward(const RmsNormParams& params, cudaStream_t stream);
// `blocks`: rms_norm_backward_blocks(rows, device), the partials the caller allocated.
cudaError_t launch_rms_norm_backward(const RmsNormParams& params, int blocks, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
