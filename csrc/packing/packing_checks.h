// Argument checks shared by the CPU and CUDA packing ops.
#pragma once

#include "hasten/checks.h"

namespace hasten {

inline void check_varlen_meta_args(const at::Tensor& position_ids) {
  check_dtype(position_ids, "varlen_meta", "position_ids", {at::kLong, at::kInt});
  TORCH_CHECK(position_ids.dim() >= 1, "hasten::varlen_meta: `position_ids` must have at least one "
              "dimension (rows, tokens), got a scalar");
  check_fits_int32(position_ids.numel(), "varlen_meta", "the number of tokens");
}

}  // namespace hasten
