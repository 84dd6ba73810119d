// Argument checks of hasten::rms_norm and rms_norm_backward (CPU and CUDA).
#pragma once

#include <torch/types.h>

#include "hasten/checks.h"
#include "../rope/rope_checks.h"

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

// add_rms_norm: x and residual of one shape, dtype and device (the norm's checks on x and weight).
inline void check_add_rms_norm_args(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight) {
  const char* op = "add_rms_norm";
  check_rms_norm_args(op, x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes(), "hasten::", op, ": `residual` must have the shape of `x` ",
              shape(x.sizes()), ", got ", shape(residual.sizes()));
  check_same_dtype(x, residual, op, "x", "residual");
  check_same_device(x, residual, op, "x", "residual");
}

// rms_norm_backward's grad_add: the shape and dtype of grad_x.
inline void check_grad_add(const at::Tensor& grad_add, const at::Tensor& x) {
  const char* op = "rms_norm_backward";
  TORCH_CHECK(grad_add.sizes() == x.sizes(), "hasten::", op, ": `grad_add` must have the shape of `x` ",
              shape(x.sizes()), ", got ", shape(grad_add.sizes()));
  check_same_dtype(x, grad_add, op, "x", "grad_add");
  check_same_device(x, grad_add, op, "x", "grad_add");
}

// rms_norm_rope: x (batch, heads, length, head_dim) as rope takes it, weight (head_dim,) as rms_norm
// takes it, cos and sin of x's dtype (the kernel reads them as x's elements).
inline void check_rms_norm_rope_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                                     const at::Tensor& cos, const at::Tensor& sin) {
  check_rope_args(x, cos, sin, op);
  check_rms_norm_args(op, x, weight);
  check_same_dtype(x, cos, op, "x", "cos");
}

inline void check_rms_norm_rope_backward_args(const at::Tensor& grad_out, const at::Tensor& x,
                                              const at::Tensor& weight, const at::Tensor& rstd,
                                              const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "rms_norm_rope_backward";
  check_rms_norm_rope_args(op, x, weight, cos, sin);
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "hasten::", op, ": `grad_out` must have the shape of `x` ",
              shape(x.sizes()), ", got ", shape(grad_out.sizes()));
  TORCH_CHECK(grad_out.stride(3) == 1 || grad_out.size(3) <= 1, "hasten::", op,
              ": `grad_out` must be contiguous along head_dim");
  check_same_dtype(x, grad_out, op, "x", "grad_out");
  check_same_device(x, grad_out, op, "x", "grad_out");
  check_dtype(rstd, op, "rstd", {at::kFloat});
  TORCH_CHECK(rstd.dim() == 3 && rstd.size(0) == x.size(0) && rstd.size(1) == x.size(1) && rstd.size(2) == x.size(2),
              "hasten::", op, ": `rstd` must be (batch, heads, length) = ", shape(x.sizes().slice(0, 3)), ", got ",
              shape(rstd.sizes()));
  check_same_device(x, rstd, op, "x", "rstd");
}

}  // namespace hasten
