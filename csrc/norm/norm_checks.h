// Argument checks of hasten::rms_norm and rms_norm_backward (CPU and CUDA).
#pragma once

#include <torch/types.h>

#include "hasten/checks.h"

namespace hasten {

inline void check_rms_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1, "hasten::", op, ": `x` must have a hidden dimension");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "hasten::", op, ": `weight` must be (",
              num(x.size(-1)), ",) to match the last dimension of `x`, got shape ", shape(weight.sizes()));
  check_dtype(x, op, "x", {at::kFloat, at::kHalf, at::kBFloat16});
  check_same_dtype(x, weight, op, "x", "weight");
  check_same_device(x, weight, op, "x", "weight");
}

inline void check_rms_norm_backward_args(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                                         const at::Tensor& rstd) {
  const char* op = "rms_norm_backward";
  check_rms_norm_args(op, x, weight);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "hasten::", op, ": `grad_y` must have the shape of `x` ",
              shape(x.sizes()), ", got ", shape(grad_y.sizes()));
  check_same_dtype(x, grad_y, op, "x", "grad_y");
  check_dtype(rstd, op, "rstd", {at::kFloat});
  TORCH_CHECK(rstd.numel() * x.size(-1) == x.numel(), "hasten::", op, ": `rstd` must hold one value per row of `x`");
  check_same_device(x, grad_y, op, "x", "grad_y");
  check_same_device(x, rstd, op, "x", "rstd");
}

}  // namespace hasten
