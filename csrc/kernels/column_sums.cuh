// Torch-free, host-includable interface of the column sums that finish a norm's weight gradient:
// the norm kernels (rms_norm.cuh, rms_norm_rope.cuh) leave one float32 row of partial sums per
// block; these add the rows, in row order, and write each column's total in the weight's element
// type. One launch in place of torch's sum and cast (two: about 12 us and 2 us a call at W1's
// shapes, 113 calls a step at 5b235b3).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

// out[c] = sum over r of partial[r * columns + c] (float32, r in order), rounded to `type`.
cudaError_t launch_column_sums(const float* partial, int64_t rows, int64_t columns, void* out, ElementType type,
                               cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
