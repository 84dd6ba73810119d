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
#include "moe_route_limits.h"

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
// out[p] = slot_scale[s] * x[s / top_k] with s = permutation[p]; moe_permute_parts(S, E) blocks a
// bucket (part-major order, so that the rows of a token are read close together in time)
cudaError_t launch_moe_permute(const MoePermuteParams& params, cudaStream_t stream);
int64_t moe_permute_parts(int64_t num_slots, int num_experts);

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

// The router's choice after its logits (hasten::moe_route): one warp per token.
enum class RouteScoring {
  kSoftmax,      // scores = softmax(logits) over the experts, in float
  kSigmoid,      // scores = sigmoid(logits)
  kTopkSoftmax,  // choose on the logits; the weights are the softmax of the k chosen logits
};
enum class GroupScore { kMax, kTop2Sum };  // a group's score: its largest choice value, or its two largest summed

struct MoeRouteSpec {
  int num_experts, top_k;
  RouteScoring scoring;
  // group-limited top-k: the experts in num_groups contiguous groups; the choice is kept to the
  // top_groups best groups, the others' choice values set to masked_choice (the model's
  // masked_fill value: DeepSeek-V2 0.0, DeepSeek-V3 -inf); num_groups 1: off
  int num_groups, top_groups;
  GroupScore group_score;
  float masked_choice;
  bool renormalize;      // weights /= (sum of the k weights + renorm_epsilon)
  float renorm_epsilon;
  float scale;           // then weights *= scale
};

// choice value c[e] = score[e] + selection_bias[e] (bias: optional, in the choice only), set to
// masked_choice outside the top groups; ids = top-k of c (descending, ties to the lower expert).
// Weight before renormalising: with a selection bias the chosen expert's score, else its choice
// value (a chosen but masked expert weighs masked_choice, without gradient, as topk over the
// masked scores gives); kTopkSoftmax: softmax over the k chosen values.
struct MoeRouteParams {
  const void* logits;          // (T, E) element type `type`, rows of `logits_stride`
  ElementType type;
  int64_t logits_stride;
  const void* selection_bias;  // (E,) element type `bias_type`, or nullptr
  ElementType bias_type;
  int64_t num_tokens;
  MoeRouteSpec spec;
  float* weights;              // (T, k) float32
  int64_t* ids;                // (T, k)
};
cudaError_t launch_moe_route(const MoeRouteParams& params, cudaStream_t stream);

// d logits (T, E) in the logits' type from d weights (T, k) float32, the forward's logits and ids
// (its scores and group mask are recomputed from the logits)
struct MoeRouteBackwardParams {
  const float* grad_weights;   // (T, k)
  const void* logits;          // (T, E), rows of `logits_stride`
  ElementType type;
  int64_t logits_stride;
  const void* selection_bias;  // as the forward's
  ElementType bias_type;
  const int64_t* ids;          // (T, k) from the forward
  void* grad_logits;           // (T, E) contiguous, element type `type`
  int64_t num_tokens;
  MoeRouteSpec spec;
};
cudaError_t launch_moe_route_backward(const MoeRouteBackwardParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
