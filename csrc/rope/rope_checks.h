// Argument checks of hasten::rope (CPU and CUDA).
#pragma once

#include <torch/types.h>

#include "hasten/checks.h"

namespace hasten {

inline void check_rope_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rope";
  TORCH_CHECK(x.dim() == 4, "hasten::rope: `x` must be (batch, heads, length, head_dim), got shape ", shape(x.sizes()));
  TORCH_CHECK(x.size(3) % 2 == 0, "hasten::rope: head_dim must be even, got ", num(x.size(3)));
  TORCH_CHECK(x.stride(3) == 1 || x.size(3) <= 1, "hasten::rope: `x` must be contiguous along head_dim");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == x.size(2) && t->size(2) == x.size(3) &&
                    (t->size(0) == x.size(0) || t->size(0) == 1),
                "hasten::rope: `cos` and `sin` must be (batch or 1, length=", num(x.size(2)), ", head_dim=",
                num(x.size(3)), "), got shape ", shape(t->sizes()),
                "; partial rotary embeddings (rotary dim < head_dim) are not covered");
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1, "hasten::rope: `cos` and `sin` must be contiguous along head_dim");
    check_same_device(x, *t, op, "x", "cos/sin");
  }
  check_dtype(x, op, "x", {at::kFloat, at::kHalf, at::kBFloat16});
  check_dtype(cos, op, "cos", {at::kFloat, at::kHalf, at::kBFloat16});
  check_same_dtype(cos, sin, op, "cos", "sin");
}

}  // namespace hasten
