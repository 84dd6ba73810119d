// Argument checks shared by the CPU and CUDA MoE ops (one place for both backends).
#pragma once

#include <optional>
#include <string>

#include "../kernels/moe_route_limits.h"
#include "hasten/checks.h"

namespace hasten {

inline void check_moe_group_args(const at::Tensor& expert_ids, int64_t num_experts) {
  check_dtype(expert_ids, "moe_group", "expert_ids", {at::kLong, at::kInt});
  check_dim(expert_ids, 2, "moe_group", "expert_ids", "(tokens, top_k)");
  TORCH_CHECK(num_experts >= 1, "hasten::moe_group: num_experts must be at least 1, got ", num(num_experts));
  check_fits_int32(expert_ids.numel(), "moe_group", "tokens * top_k");
}

inline void check_routing_args(const char* op, const at::Tensor& rows, const at::Tensor& index,
                               const at::Tensor& offsets, int64_t top_k) {
  check_dim(rows, 2, op, "rows", "2-D (rows, hidden)");
  check_dtype(index, op, "permutation/inverse", {at::kInt});
  check_dtype(offsets, op, "offsets", {at::kInt});
  check_dim(index, 1, op, "permutation/inverse", "1-D (slots,)");
  check_dim(offsets, 1, op, "offsets", "1-D (experts + 1,)");
  TORCH_CHECK(offsets.numel() >= 2, "hasten::", op, ": `offsets` needs experts + 1 >= 2 entries");
  TORCH_CHECK(top_k >= 1, "hasten::", op, ": top_k must be at least 1, got ", num(top_k));
  TORCH_CHECK(index.numel() % top_k == 0, "hasten::", op, ": slots (", num(index.numel()), ") must be tokens * top_k (",
              num(top_k), ")");
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kHalf ||
                  rows.scalar_type() == at::kBFloat16 || (rows.scalar_type() == at::kDouble && rows.is_cpu()),
              "hasten::", op, ": rows must be float32, float16 or bfloat16 (float64 on the CPU), got ",
              rows.scalar_type());
  check_same_device(rows, index, op, "rows", "permutation/inverse");
  check_same_device(rows, offsets, op, "rows", "offsets");
}

// x (T, H), slot_scale (S,) or none
inline void check_permute_args(const at::Tensor& x, const at::Tensor& permutation, const at::Tensor& offsets,
                               int64_t top_k, const std::optional<at::Tensor>& slot_scale) {
  check_routing_args("moe_permute", x, permutation, offsets, top_k);
  check_size(x, 0, permutation.numel() / top_k, "moe_permute", "x", "tokens = slots / top_k");
  if (slot_scale.has_value()) {
    check_same_dtype(x, *slot_scale, "moe_permute", "x", "slot_scale");
    TORCH_CHECK(slot_scale->numel() == permutation.numel(), "hasten::moe_permute: `slot_scale` needs one value per "
                "slot (", num(permutation.numel()), "), got shape ", shape(slot_scale->sizes()));
    check_same_device(x, *slot_scale, "moe_permute", "x", "slot_scale");
  }
}

// bias (E, H) of the combine ops: one row per expert of offsets, y's width, dtype and device
inline void check_expert_bias(const char* op, const at::Tensor& y, const at::Tensor& offsets,
                              const std::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return;
  check_dim(*bias, 2, op, "bias", "2-D (experts, hidden)");
  check_same_dtype(y, *bias, op, "y", "bias");
  check_size(*bias, 0, offsets.numel() - 1, op, "bias", "experts = offsets - 1");
  check_size(*bias, 1, y.size(1), op, "bias", "hidden of y");
  check_same_device(y, *bias, op, "y", "bias");
}

// y (S, H), weights (T, top_k) or none, bias (E, H) or none
inline void check_combine_args(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& offsets,
                               int64_t top_k, const std::optional<at::Tensor>& weights,
                               const std::optional<at::Tensor>& bias) {
  check_routing_args("moe_combine", y, inverse, offsets, top_k);
  check_expert_bias("moe_combine", y, offsets, bias);
  check_size(y, 0, inverse.numel(), "moe_combine", "y", "slots = tokens * top_k");
  if (weights.has_value()) {
    check_same_dtype(y, *weights, "moe_combine", "y", "weights");
    TORCH_CHECK(weights->numel() == inverse.numel(), "hasten::moe_combine: `weights` must be (tokens, top_k) = (",
                num(inverse.numel() / top_k), ", ", num(top_k), "), got ", shape(weights->sizes()));
    check_same_device(y, *weights, "moe_combine", "y", "weights");
  }
}

// grad_out (T, H), y (S, H), bias (E, H) or none
inline void check_weight_grad_args(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& inverse,
                                   const at::Tensor& offsets, int64_t top_k, const std::optional<at::Tensor>& bias) {
  check_routing_args("moe_combine_weight_grad", y, inverse, offsets, top_k);
  check_expert_bias("moe_combine_weight_grad", y, offsets, bias);
  check_same_dtype(y, grad_out, "moe_combine_weight_grad", "y", "grad_out");
  check_dim(grad_out, 2, "moe_combine_weight_grad", "grad_out", "2-D (tokens, hidden)");
  check_size(grad_out, 0, inverse.numel() / top_k, "moe_combine_weight_grad", "grad_out", "tokens");
  check_size(grad_out, 1, y.size(1), "moe_combine_weight_grad", "grad_out", "hidden of y");
  check_size(y, 0, inverse.numel(), "moe_combine_weight_grad", "y", "slots = tokens * top_k");
}

// The router's choice (moe_route): logits (T, E), selection_bias (E,) or none, and the spec.
constexpr int64_t kRouteMaxExperts = kernels::kMoeRouteMaxExperts, kRouteMaxTopK = kernels::kMoeRouteMaxTopK,
                  kRouteMaxGroups = kernels::kMoeRouteMaxGroups;

inline void check_route_args(const char* op, const at::Tensor& logits, int64_t top_k, const std::string& scoring,
                             int64_t num_groups, int64_t top_groups, const std::string& group_score,
                             const std::optional<at::Tensor>& selection_bias) {
  check_dim(logits, 2, op, "logits", "2-D (tokens, experts)");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kHalf ||
                  logits.scalar_type() == at::kBFloat16 || (logits.scalar_type() == at::kDouble && logits.is_cpu()),
              "hasten::", op, ": `logits` must be float32, float16 or bfloat16 (float64 on the CPU), got ",
              logits.scalar_type());
  const int64_t experts = logits.size(1);
  TORCH_CHECK(experts >= 1 && experts <= kRouteMaxExperts, "hasten::", op, ": the router's experts must be 1 to ",
              num(kRouteMaxExperts), ", got ", num(experts));
  TORCH_CHECK(top_k >= 1 && top_k <= kRouteMaxTopK && top_k <= experts, "hasten::", op, ": top_k must be 1 to ",
              num(kRouteMaxTopK), " and at most the experts (", num(experts), "), got ", num(top_k));
  TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid" || scoring == "topk_softmax", "hasten::", op,
              ": scoring must be \"softmax\", \"sigmoid\" or \"topk_softmax\", got \"", scoring, "\"");
  TORCH_CHECK(group_score == "max" || group_score == "top2_sum", "hasten::", op,
              ": group_score must be \"max\" or \"top2_sum\", got \"", group_score, "\"");
  TORCH_CHECK(num_groups >= 1 && num_groups <= kRouteMaxGroups && experts % num_groups == 0, "hasten::", op,
              ": num_groups must be 1 to ", num(kRouteMaxGroups), " and divide the experts (", num(experts), "), got ",
              num(num_groups));
  if (num_groups > 1) {
    const int64_t group_size = experts / num_groups;
    TORCH_CHECK(top_groups >= 1 && top_groups <= num_groups && top_groups * group_size >= top_k, "hasten::", op,
                ": top_groups must be 1 to num_groups (", num(num_groups), ") and its groups must hold top_k (",
                num(top_k), ") experts, got ", num(top_groups));
    TORCH_CHECK(group_score != "top2_sum" || group_size >= 2, "hasten::", op,
                ": group_score \"top2_sum\" needs groups of at least 2 experts, got ", num(group_size));
  }
  TORCH_CHECK(scoring != "topk_softmax" || (num_groups == 1 && !selection_bias.has_value()), "hasten::", op,
              ": scoring \"topk_softmax\" takes no groups and no selection_bias");
  if (selection_bias.has_value()) {
    check_dim(*selection_bias, 1, op, "selection_bias", "1-D (experts,)");
    check_size(*selection_bias, 0, experts, op, "selection_bias", "the experts of logits");
    TORCH_CHECK(selection_bias->scalar_type() == at::kFloat || selection_bias->scalar_type() == at::kHalf ||
                    selection_bias->scalar_type() == at::kBFloat16 ||
                    (selection_bias->scalar_type() == at::kDouble && selection_bias->is_cpu()),
                "hasten::", op, ": `selection_bias` must be float32, float16 or bfloat16, got ",
                selection_bias->scalar_type());
    check_same_device(logits, *selection_bias, op, "logits", "selection_bias");
  }
}

// grad_weights (T, k) and ids (T, k) int64 of the forward on these logits
inline void check_route_backward_args(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids,
                                      int64_t top_k) {
  const char* op = "moe_route_backward";
  // the forward's weights: float32, float64 for float64 logits (CPU)
  if (logits.scalar_type() == at::kDouble) {
    check_dtype(grad_weights, op, "grad_weights", {at::kDouble});
  } else {
    check_dtype(grad_weights, op, "grad_weights", {at::kFloat});
  }
  check_dtype(ids, op, "ids", {at::kLong});
  for (const auto* t : {&grad_weights, &ids}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == logits.size(0) && t->size(1) == top_k, "hasten::", op,
                ": `grad_weights` and `ids` must be (tokens, top_k) = (", num(logits.size(0)), ", ", num(top_k),
                "), got ", shape(t->sizes()));
    check_same_device(logits, *t, op, "logits", "grad_weights/ids");
  }
}

// The experts' grouped GEMM: x (S, in) rows in expert order, weight (E, out, in), or (E, in, out)
// when transposed, group_ends (E,) int32 inclusive ends.
inline void check_group_ends(const char* op, const char* rows_arg, const at::Tensor& rows, const at::Tensor& group_ends) {
  check_dtype(group_ends, op, "group_ends", {at::kInt});
  check_dim(group_ends, 1, op, "group_ends", "1-D (experts,)");
  TORCH_CHECK(group_ends.numel() >= 1, "hasten::", op, ": `group_ends` needs one entry per expert, got none");
  check_same_device(rows, group_ends, op, rows_arg, "group_ends");
}

inline void check_grouped_float(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ||
                  (t.scalar_type() == at::kDouble && t.is_cpu()),
              "hasten::", op, ": `", arg, "` must be float32, float16 or bfloat16 (float64 on the CPU), got ",
              t.scalar_type());
}

inline void check_grouped_mm_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_ends,
                                  bool transposed) {
  const char* op = "moe_grouped_mm";
  check_dim(x, 2, op, "x", "2-D (rows, in)");
  check_dim(weight, 3, op, "weight", transposed ? "3-D (experts, in, out)" : "3-D (experts, out, in)");
  check_grouped_float(op, "x", x);
  check_same_dtype(x, weight, op, "x", "weight");
  check_size(weight, transposed ? 1 : 2, x.size(1), op, "weight", "the columns of x (in)");
  check_group_ends(op, "x", x, group_ends);
  check_size(group_ends, 0, weight.size(0), op, "group_ends", "the experts of weight");
  check_same_device(x, weight, op, "x", "weight");
}

// a (S, M), b (S, N) rows in expert order -> (E, M, N)
inline void check_grouped_mm_weight_grad_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends) {
  const char* op = "moe_grouped_mm_weight_grad";
  check_dim(a, 2, op, "a", "2-D (rows, M)");
  check_dim(b, 2, op, "b", "2-D (rows, N)");
  check_grouped_float(op, "a", a);
  check_same_dtype(a, b, op, "a", "b");
  check_size(b, 0, a.size(0), op, "b", "the rows of a");
  check_group_ends(op, "a", a, group_ends);
  check_same_device(a, b, op, "a", "b");
}

// gate_up (R, 2I): [gate | up] per row; grad_act (R, I) for the backward
}  // namespace hasten
