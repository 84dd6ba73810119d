// The router's choice after its logits, one warp per token (moe.cuh: MoeRouteSpec), forward and
// backward. Expert e sits in lane e % 32, value e / 32, the layout of torch's warp softmax
// (PersistentSoftmax.cuh): each lane sums its values in order, then a butterfly over the warp, so
// the softmax scores are torch's bit for bit (lanes without experts add exact zeros). expf without
// fast math, as torch's kernels. Top-k: k rounds of a warp arg-max (ties to the lower expert).
#include <climits>
#include <cmath>

#include "dtype_utils.cuh"
#include "moe.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kRouteWarps = 4;  // tokens per block
constexpr int kRouteThreads = kRouteWarps * 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(kFullMask, v, offset);
    v = v < other ? other : v;
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Whether (a, ia) ranks before (b, ib) in top-k: NaN first (torch.topk ranks NaN largest), then
// the larger value, then the lower index.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// The warp's best (value, index) of each lane's candidate; every lane gets it.
__device__ __forceinline__ void warp_arg_best(float& value, int& index) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(kFullMask, value, offset);
    const int other_index = __shfl_xor_sync(kFullMask, index, offset);
    if (ranks_before(other, other_index, value, index)) {
      value = other;
      index = other_index;
    }
  }
}

__device__ __forceinline__ float load_float(const void* base, ElementType type, int64_t i) {
  switch (type) {
    case ElementType::kFloat32: return static_cast<const float*>(base)[i];
    case ElementType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

// One token's scores: softmax (torch's warp softmax, bit for bit), sigmoid (torch's
// 1 / (1 + exp(-x))), or the logits themselves (kTopkSoftmax). Values past E are -inf.
template <typename T, int N>
__device__ __forceinline__ void token_scores(const MoeRouteSpec& s, const T* row, int lane, float (&score)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    score[i] = e < s.num_experts ? to_float(row[e]) : -INFINITY;
  }
  if (s.scoring == RouteScoring::kSoftmax) {
    float max_value = score[0];
#pragma unroll
    for (int i = 0; i < N; ++i) max_value = max_value > score[i] ? max_value : score[i];
    max_value = warp_max(max_value);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      score[i] = expf(score[i] - max_value);
      sum += score[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < N; ++i) score[i] = sum == 0.0f ? NAN : score[i] / sum;
  } else if (s.scoring == RouteScoring::kSigmoid) {
#pragma unroll
    for (int i = 0; i < N; ++i) score[i] = 1.0f / (1.0f + expf(-score[i]));
  }
}

// The choice values: score + selection bias, and with groups masked_choice outside the top_groups
// best groups (group score: max, or the sum of the two largest). `row` is this warp's shared scratch
// of E floats. Returns the bit mask of the groups kept (all where the choice is not group-limited).
template <int N>
__device__ __forceinline__ unsigned token_choice(const MoeRouteSpec& s, const float (&score)[N], const void* bias, ElementType bias_type,
                                                 int lane, float* row, float (&choice)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    choice[i] = score[i];
    if (bias != nullptr && e < s.num_experts) choice[i] += load_float(bias, bias_type, e);
  }
  if (s.num_groups <= 1) return kFullMask;
  const int group_size = s.num_experts / s.num_groups;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    if (e < s.num_experts) row[e] = choice[i];
  }
  __syncwarp();
  float group_value = -INFINITY;
  if (lane < s.num_groups) {
    float first = -INFINITY, second = -INFINITY;
    for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
      const float v = row[e];
      if (ranks_before(v, 0, first, 1)) {
        second = first;
        first = v;
      } else if (ranks_before(v, 0, second, 1)) {
        second = v;
      }
    }
    group_value = s.group_score == GroupScore::kMax ? first : first + second;
  }
  __syncwarp();  // the scratch is free for the next use
  unsigned kept = 0, taken = 0;
  for (int j = 0; j < s.top_groups; ++j) {
    float best = (lane < s.num_groups && !((taken >> lane) & 1u)) ? group_value : -INFINITY;
    int best_index = (lane < s.num_groups && !((taken >> lane) & 1u)) ? lane : INT_MAX;
    warp_arg_best(best, best_index);
    kept |= 1u << best_index;
    taken |= 1u << best_index;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int e = lane + 32 * i;
    if (e < s.num_experts && !((kept >> (e / group_size)) & 1u)) choice[i] = s.masked_choice;
  }
  return kept;
}

template <typename T, int N>
__global__ void __launch_bounds__(kRouteThreads) moe_route_kernel(MoeRouteParams p) {
  __shared__ float scratch[kRouteWarps][kMoeRouteMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const MoeRouteSpec& s = p.spec;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp; t < p.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kRouteWarps) {
    float score[N], choice[N];
    token_scores<T, N>(s, static_cast<const T*>(p.logits) + t * p.logits_stride, lane, score);
    token_choice<N>(s, score, p.selection_bias, p.bias_type, lane, scratch[warp], choice);
    unsigned taken = 0;  // bit i: this lane's value i is chosen
    int my_id = 0;
    float my_weight = 0.0f;  // lane j: the j-th chosen expert's weight before renormalising
    for (int j = 0; j < s.top_k; ++j) {
      float best = -INFINITY;
      int best_index = INT_MAX;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int e = lane + 32 * i;
        if (e < s.num_experts && !((taken >> i) & 1u) && ranks_before(choice[i], e, best, best_index)) {
          best = choice[i];
          best_index = e;
        }
      }
      warp_arg_best(best, best_index);
      const int owner = best_index & 31, slot = best_index >> 5;
      float raw = 0.0f;  // the owner's weight of the chosen expert: its score with a selection bias, else its choice
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i == slot) raw = p.selection_bias != nullptr ? score[i] : choice[i];
      }
      if (lane == owner) taken |= 1u << slot;
      raw = __shfl_sync(kFullMask, raw, owner);
      if (lane == j) {
        my_id = best_index;
        my_weight = raw;
      }
    }
    const bool mine = lane < s.top_k;
    if (s.scoring == RouteScoring::kTopkSoftmax) {  // torch's warp softmax over the k values
      const float max_value = warp_max(mine ? my_weight : -INFINITY);
      const float e = mine ? expf(my_weight - max_value) : 0.0f;
      my_weight = e / warp_sum(e);
    }
    if (s.renormalize) my_weight = my_weight / (warp_sum(mine ? my_weight : 0.0f) + s.renorm_epsilon);
    my_weight = my_weight * s.scale;
    if (mine) {
      p.weights[t * s.top_k + lane] = my_weight;
      p.ids[t * s.top_k + lane] = my_id;
    }
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kRouteThreads) moe_route_backward_kernel(MoeRouteBackwardParams p) {
  __shared__ float scratch[kRouteWarps][kMoeRouteMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const MoeRouteSpec& s = p.spec;
  float* row = scratch[warp];
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps + warp; t < p.num_tokens;
       t += static_cast<int64_t>(gridDim.x) * kRouteWarps) {
    float score[N], choice[N];
    token_scores<T, N>(s, static_cast<const T*>(p.logits) + t * p.logits_stride, lane, score);
    // the groups kept: only a choice without a selection bias weighs by its masked value
    unsigned kept = kFullMask;
    if (s.num_groups > 1 && p.selection_bias == nullptr) {
      kept = token_choice<N>(s, score, p.selection_bias, p.bias_type, lane, row, choice);
    }
    const bool mine = lane < s.top_k;
    const int my_id = mine ? static_cast<int>(p.ids[t * s.top_k + lane]) : 0;
    const float g = mine ? p.grad_weights[t * s.top_k + lane] * s.scale : 0.0f;
    // the chosen expert's score, through the scratch row
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = lane + 32 * i;
      if (e < s.num_experts) row[e] = score[i];
    }
    __syncwarp();
    const int group_size = s.num_groups > 1 ? s.num_experts / s.num_groups : s.num_experts;
    const bool masked = mine && !((kept >> (my_id / group_size)) & 1u);
    const float my_score = mine ? row[my_id] : 0.0f;
    __syncwarp();
    float u = masked ? s.masked_choice : my_score;  // the weight before renormalising
    float q = 0.0f;
    if (s.scoring == RouteScoring::kTopkSoftmax) {
      const float max_value = warp_max(mine ? u : -INFINITY);
      const float e = mine ? expf(u - max_value) : 0.0f;
      q = e / warp_sum(e);
      u = q;
    }
    float du = g;  // d(u / D) * scale, then through the renormalisation
    if (s.renormalize) {
      const float denominator = warp_sum(mine ? u : 0.0f) + s.renorm_epsilon;
      const float dot = warp_sum(mine ? g * u : 0.0f);
      du = g / denominator - dot / (denominator * denominator);
    }
    float dv = du;  // d of the chosen value (logit, score)
    if (s.scoring == RouteScoring::kTopkSoftmax) dv = q * (du - warp_sum(mine ? du * q : 0.0f));
    if (masked || !mine) dv = 0.0f;
    // scatter the chosen gradients into the scratch row (experts distinct), then each lane's values
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = lane + 32 * i;
      if (e < s.num_experts) row[e] = 0.0f;
    }
    __syncwarp();
    if (mine) row[my_id] = dv;
    __syncwarp();
    const float softmax_dot = s.scoring == RouteScoring::kSoftmax ? warp_sum(mine ? dv * my_score : 0.0f) : 0.0f;
    T* out = static_cast<T*>(p.grad_logits) + t * s.num_experts;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = lane + 32 * i;
      if (e >= s.num_experts) continue;
      const float d = row[e];
      float grad;
      if (s.scoring == RouteScoring::kSoftmax) {
        grad = d * score[i] - score[i] * softmax_dot;  // p (dp - sum(dp p)), as torch's softmax backward
      } else if (s.scoring == RouteScoring::kSigmoid) {
        grad = d * (1.0f - score[i]) * score[i];
      } else {
        grad = d;
      }
      out[e] = from_float<T>(grad);
    }
    __syncwarp();  // the scratch row is read before the next token writes it
  }
}

// The kernel of each params type (forward, backward) for element type T and N values per lane
template <typename T, int N>
void start(const MoeRouteParams& p, unsigned grid, cudaStream_t stream) {
  moe_route_kernel<T, N><<<grid, kRouteThreads, 0, stream>>>(p);
}
template <typename T, int N>
void start(const MoeRouteBackwardParams& p, unsigned grid, cudaStream_t stream) {
  moe_route_backward_kernel<T, N><<<grid, kRouteThreads, 0, stream>>>(p);
}

// A warp per token, looping past the grid's cap (each block's warps stride over the tokens)
template <int N, typename Params>
cudaError_t launch_rows(const Params& p, cudaStream_t stream) {
  constexpr int64_t kMaxBlocks = 65535 * 32;
  const int64_t blocks = (p.num_tokens + kRouteWarps - 1) / kRouteWarps;
  const unsigned grid = static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
  return HASTEN_DISPATCH_ELEMENT(p.type, {
    start<T, N>(p, grid, stream);
    return cudaGetLastError();
  });
}

// Values per lane: the fewest that hold E experts (more only add exact zeros to the sums)
template <typename Params>
cudaError_t launch_by_experts(const Params& p, cudaStream_t stream) {
  const int e = p.spec.num_experts, k = p.spec.top_k;
  if (e <= 0 || e > kMoeRouteMaxExperts || k < 1 || k > kMoeRouteMaxTopK || k > e) return cudaErrorInvalidValue;
  if (p.num_tokens == 0) return cudaSuccess;
  if (e <= 32) return launch_rows<1>(p, stream);
  if (e <= 64) return launch_rows<2>(p, stream);
  if (e <= 128) return launch_rows<4>(p, stream);
  if (e <= 256) return launch_rows<8>(p, stream);
  return launch_rows<16>(p, stream);
}

}  // namespace

cudaError_t launch_moe_route(const MoeRouteParams& p, cudaStream_t stream) { return launch_by_experts(p, stream); }

cudaError_t launch_moe_route_backward(const MoeRouteBackwardParams& p, cudaStream_t stream) {
  return launch_by_experts(p, stream);
}

}  // namespace kernels
}  // namespace hasten
