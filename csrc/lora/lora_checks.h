// Argument checks of hasten::lora_linear and its backward (every device shares them).
#pragma once

#include "hasten/checks.h"

namespace hasten {

// x (..., in); x_lora (x's shape) or none; weight (out, in) and bias (out) in x's dtype; lora_a
// (r, in) and lora_b (out, r) floating, each in one dtype (float32 master copies or x's dtype).
inline void check_lora_linear_args(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& x_lora,
                                   const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                   const at::Tensor& lora_a, const at::Tensor& lora_b) {
  TORCH_CHECK(x.dim() >= 1, "hasten::", op, ": `x` must be (..., in_features), got a scalar");
  check_dim(weight, 2, op, "weight", "(out_features, in_features)");
  check_dim(lora_a, 2, op, "lora_a", "(rank, in_features)");
  check_dim(lora_b, 2, op, "lora_b", "(out_features, rank)");
  const int64_t in = x.size(-1), out = weight.size(0), rank = lora_a.size(0);
  TORCH_CHECK(weight.size(1) == in, "hasten::", op, ": `weight` ", shape(weight.sizes()), " must have x's last size ",
              num(in), " as its second size");
  TORCH_CHECK(lora_a.size(1) == in, "hasten::", op, ": `lora_a` ", shape(lora_a.sizes()), " must be (rank, ", num(in),
              ")");
  TORCH_CHECK(lora_b.size(0) == out && lora_b.size(1) == rank, "hasten::", op, ": `lora_b` ", shape(lora_b.sizes()),
              " must be (", num(out), ", ", num(rank), "): (out_features, rank)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "hasten::", op, ": the base `weight` (", weight.scalar_type(),
              ") must have x's dtype (", x.scalar_type(), ")");
  for (const auto* t : {&x, &lora_a, &lora_b}) {
    TORCH_CHECK(at::isFloatingType(t->scalar_type()), "hasten::", op, ": x, lora_a and lora_b must be floating, got ",
                t->scalar_type());
  }
  if (x_lora.has_value()) {
    TORCH_CHECK(x_lora->sizes() == x.sizes() && x_lora->scalar_type() == x.scalar_type(), "hasten::", op,
                ": `x_lora` (the LoRA path's input after dropout) must have x's shape and dtype");
    check_same_device(x, *x_lora, op, "x", "x_lora");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out && bias->scalar_type() == x.scalar_type(), "hasten::", op,
                ": `bias` must be (", num(out), ",) in x's dtype");
    check_same_device(x, *bias, op, "x", "bias");
  }
  for (const auto* t : {&weight, &lora_a, &lora_b}) check_same_device(x, *t, op, "x", "weight, lora_a or lora_b");
}

}  // namespace hasten
