// Helpers of the torch-facing CUDA glue (*_cuda.cpp, host compiler only): the kernels' element
// type of a tensor and the check after a launch, with messages that name the op.
#pragma once

#include <cuda_runtime.h>
#include <torch/types.h>

#include "../../kernels/element_type.h"

namespace hasten {

inline kernels::ElementType element_type(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::ElementType::kFloat32;
    case at::kHalf: return kernels::ElementType::kFloat16;
    case at::kBFloat16: return kernels::ElementType::kBFloat16;
    default:
      TORCH_CHECK(false, "hasten::", op, ": CUDA kernels take float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "hasten::", op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace hasten
