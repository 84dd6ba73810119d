// Argument checks shared by the CPU and CUDA MoE ops (one place for both backends).
#pragma once

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

}  // namespace hasten
