// Torch-free, host-includable interface of the MoE kernels: grouping, permute, combine.
// Layout conventions (S = T * top_k token-expert slots, slot s = token s / top_k, choice s % top_k):
//   expert_ids   (S,) int32/int64, valid ids in [0, E); others are "dropped" slots
//   offsets      (E + 1,) int32, exclusive starts; offsets[E] = number of valid slots
//   permutation  (S,) int32, sorted position -> slot (valid slots by expert, stable by slot;
//                dropped slots last, stable)
//   inverse      (S,) int32, slot -> sorted position
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

constexpr int kMoeMaxExperts = 512;  // shared-memory histograms per block are sized for this

struct MoeGroupParams {
  const void* expert_ids;
  bool ids_int64;
  int64_t num_slots;
  int num_experts;
  int32_t* counts;       // (E,)
  int32_t* offsets;      // (E + 1,)
  int32_t* permutation;  // (S,)
  int32_t* inverse;      // (S,)
  int32_t* workspace;    // moe_group_workspace_ints(...) ints, any content
};

// Ints of scratch the grouping launch needs (per-block histograms).
int64_t moe_group_workspace_ints(int64_t num_slots, int num_experts, int device);
// One cooperative launch: histogram, grid-wide barrier, scan, stable scatter.
cudaError_t launch_moe_group(const MoeGroupParams& params, int device, cudaStream_t stream);

struct MoePermuteParams {
  const void* x;               // (T, H) rows of tokens
  const int32_t* permutation;  // (S,)
  const int32_t* offsets;      // (E + 1,); rows at positions >= offsets[E] are written as zeros
  const void* slot_scale;      // (S,) same element type as x, or nullptr: row p scaled by slot_scale[slot]
  void* out;                   // (S, H)
  int64_t num_slots, hidden;
  int num_experts, top_k;
  ElementType type;
};
// out[p] = slot_scale[s] * x[s / top_k] with s = permutation[p]
cudaError_t launch_moe_permute(const MoePermuteParams& params, cudaStream_t stream);

struct MoeCombineParams {
  const void* y;           // (S, H) rows in sorted order
  const int32_t* inverse;  // (S,)
  const int32_t* offsets;  // (E + 1,); positions >= offsets[E] (dropped slots) contribute nothing
  const void* weights;     // (T, top_k) same element type as y, or nullptr for weight 1
  void* out;               // (T, H)
  int64_t num_tokens, hidden;
  int num_experts, top_k;
  ElementType type;
  // (E, H) same element type as y, or nullptr: the row's expert bias added to y first, rounded to
  // the element type as the model's `y + bias` is (gpt-oss's down_proj bias; one pass over y saved)
  const void* bias = nullptr;
};
// out[t] = sum_j weights[t, j] * round(y[p] + bias[expert of p]), p = inverse[t * top_k + j], in a
// fixed order, float accumulation
cudaError_t launch_moe_combine(const MoeCombineParams& params, cudaStream_t stream);

struct MoeCombineWeightGradParams {
  const void* grad_out;    // (T, H)
  const void* y;           // (S, H)
  const int32_t* inverse;  // (S,)
  const int32_t* offsets;  // (E + 1,)
  void* grad_weights;      // (T, top_k)
  int64_t num_tokens, hidden;
  int num_experts, top_k;
  ElementType type;
  const void* bias = nullptr;  // (E, H) or nullptr, as MoeCombineParams::bias
};
// grad_weights[t, j] = dot(grad_out[t], round(y[p] + bias[expert of p])), p = inverse[t * top_k + j]
// (0 for dropped slots)
cudaError_t launch_moe_combine_weight_grad(const MoeCombineWeightGradParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
