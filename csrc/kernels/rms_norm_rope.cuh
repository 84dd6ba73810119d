// Torch-free, host-includable interface of the fused head norm + rotary embedding: the q_norm or
// k_norm of Qwen3, Gemma 3 and others (an RMSNorm over each head's D features) followed by the
// rotary embedding of the same tensor. For each row x (one head of one token, D features):
//   forward   rstd = 1 / sqrt(mean(x^2) + eps)  (float32, kept for backward)
//             y = (weight + offset) * round_to_T(x * rstd), rounded to T   (rms_norm.cuh's y)
//             out = rope(y)                                                (rope.cuh's forward)
//   backward  g = rope^T(grad_out), rounded to T                           (rope.cuh's backward)
//             n = x * rstd, wg = (weight + offset) * g
//             grad_x = rstd * (wg - n * mean(wg * n))                      (rms_norm.cuh's backward)
//             grad_weight_partial[b, :] = sum of g * round_to_T(n) over the rows block b handled
// The values hasten::rms_norm then hasten::rope give (backward: rope, then rms_norm_backward),
// without y and g going through memory: one read and one write of the tensor fewer each way.
//
// Layout: x, out, grad_out (B, H, L, D) with any strides that are multiples of a 16-byte vector
// and a unit stride along D (q and k arrive as transposed views of (B, L, H, D)); rstd (B, H, L)
// contiguous float32; weight (D,); cos, sin (B or 1, L, R) of x's type, rows of R contiguous.
// A row is D / V 16-byte vectors (V = 16 / sizeof(T)), one per lane of a group of lanes: D a
// multiple of V and at most 32 V (256 bf16 features). rotate_half's pairs (j, j + R/2) must start
// on vector boundaries (R/2 a multiple of V); interleaved pairs (2j, 2j + 1) need R a multiple of
// V. rms_norm_rope_fits says which shapes the kernels take; others are cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

struct RmsNormRopeParams {
  const void* x;
  const void* grad_out;  // backward only
  void* out;             // forward: out; backward: grad_x (x's layout, own strides)
  const void* weight;    // (D,)
  const void* cos;
  const void* sin;
  float* rstd;                 // (B, H, L) contiguous: written forward, read backward
  float* grad_weight_partial;  // backward: (blocks, D), written whole; nullptr: no weight gradient
  int64_t batch, heads, length, dim;  // B, H, L, D
  int64_t rotary_dim;                 // R: the first R features rotate, the others pass through
  int64_t x_stride[3];     // batch, head, position (elements)
  int64_t out_stride[3];
  int64_t grad_stride[3];  // grad_out's
  int64_t cs_stride[2];    // batch (0 when broadcast), position; cos and sin share them
  float eps, offset;
  bool interleaved;
  ElementType type;  // of x, out, grad_out, weight, cos and sin
};

// Whether the kernels take rows of `dim` features of `element_bytes` each, rotary dim `rotary_dim`
// (pointers and strides are the caller's to align: multiples of 16 bytes).
bool rms_norm_rope_fits(int64_t dim, int64_t rotary_dim, bool interleaved, int element_bytes);
cudaError_t launch_rms_norm_rope_forward(const RmsNormRopeParams& params, cudaStream_t stream);
// `blocks`: rms_norm_backward_blocks(rows, device) (rms_norm.cuh), the partials the caller allocated.
cudaError_t launch_rms_norm_rope_backward(const RmsNormRopeParams& params, int blocks, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
