// Argument checks of hasten::rope (CPU and CUDA): x (batch, heads, length, head_dim), cos and sin
// (batch or 1, length, rotary_dim) of one shape, rotary_dim even and 0 < rotary_dim <= head_dim;
// float32, float16 or bfloat16 (and float64 on the CPU).
#pragma once

#include <torch/types.h>

#include "hasten/checks.h"

namespace hasten {

inline void check_rope_args(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* op = "rope") {
  TORCH_CHECK(x.dim() == 4, "hasten::", op, ": `x` must be (batch, heads, length, head_dim), got shape ", shape(x.sizes()));
  TORCH_CHECK(x.stride(3) == 1 || x.size(3) <= 1, "hasten::", op, ": `x` must be contiguous along head_dim");
  // the kernels index cos and sin with one set of strides and one broadcast rule
  TORCH_CHECK(cos.sizes() == sin.sizes(), "hasten::", op, ": `cos` and `sin` must have one shape, got ",
              shape(cos.sizes()), " and ", shape(sin.sizes()));
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == x.size(2) && (t->size(0) == x.size(0) || t->size(0) == 1),
                "hasten::", op, ": `cos` and `sin` must be (batch or 1, length=", num(x.size(2)),
                ", rotary_dim), got shape ", shape(t->sizes()));
    TORCH_CHECK(t->size(2) % 2 == 0 && t->size(2) > 0 && t->size(2) <= x.size(3),
                "hasten::", op, ": the rotary dim (last dimension of `cos` and `sin`) must be even and in "
                "[2, head_dim=", num(x.size(3)), "], got ", num(t->size(2)));
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) <= 1, "hasten::", op, ": `cos` and `sin` must be contiguous along their "
                "last dimension");
    check_same_device(x, *t, op, "x", "cos/sin");
  }
  // float64 on the CPU too: the reference computes in double (exact gradchecks); the kernel takes 16/32-bit
  if (x.device().is_cpu()) {
    check_dtype(x, op, "x", {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble});
    check_dtype(cos, op, "cos", {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble});
  } else {
    check_dtype(x, op, "x", {at::kFloat, at::kHalf, at::kBFloat16});
    check_dtype(cos, op, "cos", {at::kFloat, at::kHalf, at::kBFloat16});
  }
  check_same_dtype(cos, sin, op, "cos", "sin");
}

}  // namespace hasten
