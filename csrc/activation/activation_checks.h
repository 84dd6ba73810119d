// Argument checks of the gated-MLP ops, shared by their CPU and CUDA implementations:
//   swiglu / swiglu_backward        one (rows, 2 * inner) tensor [gate | up] (MoE experts)
//   silu_mul / silu_mul_backward,   gate and up as two (..., inner) tensors of one shape (dense
//   gelu_tanh_mul / _backward       MLPs); both pairs take the same arguments: one check, by op name
//   clamped_swiglu / _backward      one (rows, 2 * inner) tensor, gate and up interleaved (gpt-oss)
//   moe_weighted_swiglu / _backward swiglu's layout in expert order, each row times its slot's
//                                   router weight (weights, permutation, offsets of the grouping)
#pragma once

#include <torch/types.h>

#include <cmath>
#include <optional>

#include "hasten/checks.h"

namespace hasten {

inline void check_swiglu_args(const char* op, const at::Tensor& gate_up) {
  check_dim(gate_up, 2, op, "gate_up", "2-D (rows, 2 * inner)");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "hasten::", op, ": `gate_up` must hold [gate | up] halves, got an odd width ",
              num(gate_up.size(1)));
}

inline void check_swiglu_backward_args(const at::Tensor& grad_act, const at::Tensor& gate_up) {
  check_swiglu_args("swiglu_backward", gate_up);
  check_same_dtype(gate_up, grad_act, "swiglu_backward", "gate_up", "grad_act");
  TORCH_CHECK(grad_act.dim() == 2 && grad_act.size(0) == gate_up.size(0) && grad_act.size(1) * 2 == gate_up.size(1),
              "hasten::swiglu_backward: `grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got ",
              shape(grad_act.sizes()), " and ", shape(gate_up.sizes()));
  check_same_device(gate_up, grad_act, "swiglu_backward", "gate_up", "grad_act");
}

// The MoE experts' weighted SwiGLU: gate_up (S, 2 * inner) in expert order, weights (T, k) with
// T * k = S in gate_up's dtype, permutation (S,) int32 (sorted row -> slot) and offsets (E + 1,)
// int32 of the grouping (moe_group), all on one device.
inline void check_weighted_swiglu_args(const char* op, const at::Tensor& gate_up, const at::Tensor& weights,
                                       const at::Tensor& permutation, const at::Tensor& offsets) {
  check_swiglu_args(op, gate_up);
  check_dtype(permutation, op, "permutation", {at::kInt});
  check_dtype(offsets, op, "offsets", {at::kInt});
  check_dim(permutation, 1, op, "permutation", "1-D (slots,)");
  check_dim(offsets, 1, op, "offsets", "1-D (experts + 1,)");
  TORCH_CHECK(offsets.numel() >= 2, "hasten::", op, ": `offsets` needs experts + 1 >= 2 entries");
  check_size(gate_up, 0, permutation.numel(), op, "gate_up", "slots of `permutation`");
  TORCH_CHECK(weights.numel() == permutation.numel(), "hasten::", op, ": `weights` must hold one value per slot (",
              num(permutation.numel()), "), got shape ", shape(weights.sizes()));
  check_same_dtype(gate_up, weights, op, "gate_up", "weights");
  check_same_device(gate_up, weights, op, "gate_up", "weights");
  check_same_device(gate_up, permutation, op, "gate_up", "permutation");
  check_same_device(gate_up, offsets, op, "gate_up", "offsets");
}

inline void check_weighted_swiglu_backward_args(const at::Tensor& grad_act, const at::Tensor& gate_up,
                                                const at::Tensor& weights, const at::Tensor& permutation,
                                                const at::Tensor& offsets) {
  const char* op = "moe_weighted_swiglu_backward";
  check_weighted_swiglu_args(op, gate_up, weights, permutation, offsets);
  check_same_dtype(gate_up, grad_act, op, "gate_up", "grad_act");
  TORCH_CHECK(grad_act.dim() == 2 && grad_act.size(0) == gate_up.size(0) && grad_act.size(1) * 2 == gate_up.size(1),
              "hasten::", op, ": `grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got ",
              shape(grad_act.sizes()), " and ", shape(gate_up.sizes()));
  check_same_device(gate_up, grad_act, op, "gate_up", "grad_act");
}

// gpt-oss's clamped SwiGLU: the same (rows, 2 * inner) shape as swiglu's, interleaved; alpha and
// limit finite, limit positive (transformers' swiglu_limit 7.0, alpha 1.702)
inline void check_clamped_swiglu_args(const char* op, const at::Tensor& gate_up, double alpha, double limit) {
  check_swiglu_args(op, gate_up);
  TORCH_CHECK(std::isfinite(alpha) && std::isfinite(limit) && limit > 0, "hasten::", op,
              ": `alpha` must be finite and `limit` finite and positive, got alpha=", alpha, ", limit=", limit);
}

// The optional expert biases: bias (E, 2 * inner) in gate_up's dtype and device with group_ends
// (E,) int32 beside it (the inclusive ends of the expert-sorted rows), or neither.
inline void check_clamped_swiglu_bias(const char* op, const at::Tensor& gate_up,
                                      const std::optional<at::Tensor>& bias,
                                      const std::optional<at::Tensor>& group_ends) {
  TORCH_CHECK(bias.has_value() == group_ends.has_value(), "hasten::", op,
              ": `bias` and `group_ends` go together (each row's expert comes from group_ends), got only ",
              bias.has_value() ? "`bias`" : "`group_ends`");
  if (!bias.has_value()) return;
  const auto& b = *bias;
  const auto& ends = *group_ends;
  TORCH_CHECK(b.dim() == 2 && b.size(0) >= 1 && b.size(1) == gate_up.size(1), "hasten::", op,
              ": `bias` must be (experts, 2 * inner) with gate_up's width ", num(gate_up.size(1)), ", got ",
              shape(b.sizes()));
  check_same_dtype(gate_up, b, op, "gate_up", "bias");
  check_same_device(gate_up, b, op, "gate_up", "bias");
  TORCH_CHECK(ends.dim() == 1 && ends.size(0) == b.size(0), "hasten::", op,
              ": `group_ends` must be (experts,) with one end per row of `bias` (", num(b.size(0)), "), got ",
              shape(ends.sizes()));
  check_dtype(ends, op, "group_ends", {at::kInt});
  check_same_device(gate_up, ends, op, "gate_up", "group_ends");
}

inline void check_clamped_swiglu_backward_args(const at::Tensor& grad_act, const at::Tensor& gate_up, double alpha,
                                               double limit) {
  check_clamped_swiglu_args("clamped_swiglu_backward", gate_up, alpha, limit);
  check_same_dtype(gate_up, grad_act, "clamped_swiglu_backward", "gate_up", "grad_act");
  TORCH_CHECK(grad_act.dim() == 2 && grad_act.size(0) == gate_up.size(0) && grad_act.size(1) * 2 == gate_up.size(1),
              "hasten::clamped_swiglu_backward: `grad_act` must be (rows, inner) of `gate_up` (rows, 2 * inner), got ",
              shape(grad_act.sizes()), " and ", shape(gate_up.sizes()));
  check_same_device(gate_up, grad_act, "clamped_swiglu_backward", "gate_up", "grad_act");
}

inline void check_gated_mul_args(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "hasten::", op, ": `gate` and `up` must have one shape, got ",
              shape(gate.sizes()), " and ", shape(up.sizes()));
  TORCH_CHECK(gate.dim() >= 1, "hasten::", op, ": `gate` must have at least one dimension");
  check_same_dtype(gate, up, op, "gate", "up");
  check_same_device(gate, up, op, "gate", "up");
}

inline void check_gated_mul_backward_args(const char* op, const at::Tensor& grad_act, const at::Tensor& gate,
                                          const at::Tensor& up) {
  check_gated_mul_args(op, gate, up);
  TORCH_CHECK(grad_act.sizes() == gate.sizes(), "hasten::", op, ": `grad_act` must have the shape of `gate` ",
              shape(gate.sizes()), ", got ", shape(grad_act.sizes()));
  check_same_dtype(gate, grad_act, op, "gate", "grad_act");
  check_same_device(gate, grad_act, op, "gate", "grad_act");
}

}  // namespace hasten
