// The weight gradient of a norm's CUDA backward from the per-block partials its kernel wrote
// (blocks, hidden) float32: summed in block order and cast to the weight's dtype in one launch
// (kernels/column_sums.cuh). Shared by rms_norm_backward and rms_norm_rope_backward.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <torch/types.h>

#include "../kernels/column_sums.cuh"
#include "hasten/cuda_glue.h"

namespace hasten {

inline at::Tensor summed_weight_grad(const at::Tensor& partial, const at::Tensor& weight, const char* op) {
  auto grad_weight = at::empty({partial.size(1)}, weight.options());
  check_launch(kernels::launch_column_sums(partial.data_ptr<float>(), partial.size(0), partial.size(1),
                                           grad_weight.data_ptr(), element_type(weight, op),
                                           c10::cuda::getCurrentCUDAStream()),
               op);
  return grad_weight;
}

}  // namespace hasten
