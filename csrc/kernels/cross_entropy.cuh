// Torch-free, host-includable interface of the cross-entropy row kernel behind
// hasten::linear_cross_entropy. One block per row of a logits chunk:
//   logits  (rows, vocab) with row stride ld, float/half/bfloat16; raw LM-head outputs
//   targets (rows,) int64; ignore_index rows give loss 0 and a zero gradient row;
//           targets outside [0, vocab) give loss NaN (loud, without a host sync)
//   loss    (rows,) float32: lse - (1 - eps) * z_t - eps / vocab * sum_j z_j, z = capped logits
//   grad    written over `logits` when grad_scale != nullptr:
//           (softmax(z) - (1 - eps) * onehot(t) - eps / vocab) * dz/dlogit * (*grad_scale)
// Softcap (cap > 0): z = cap * tanh(logit / cap). Float accumulation throughout.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

struct CrossEntropyRowsParams {
  void* logits;
  const int64_t* targets;
  float* loss;
  const float* grad_scale;  // device scalar, or nullptr: loss only, logits left untouched
  int64_t rows, vocab, ld;
  int64_t ignore_index;
  float label_smoothing;
  float softcap;
  ElementType type;
};

cudaError_t launch_cross_entropy_rows(const CrossEntropyRowsParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
