// CUDA glue of the MoE ops: checks, device guard, outputs, one kernel launch each on the
// current stream. No host sync anywhere (moe_group's valid-slot count stays on the device).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <string>
#include <tuple>

#include "../kernels/moe.cuh"
#include "hasten/cuda_glue.h"
#include "moe_checks.h"

namespace hasten {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_group_cuda(const at::Tensor& expert_ids,
                                                                          int64_t num_experts) {
  check_device(expert_ids, "moe_group", "expert_ids", c10::DeviceType::CUDA);
  check_moe_group_args(expert_ids, num_experts);
  TORCH_CHECK(num_experts <= kernels::kMoeMaxExperts, "hasten::moe_group: the CUDA kernel supports up to ",
              num(kernels::kMoeMaxExperts), " experts, got ", num(num_experts));
  const c10::cuda::CUDAGuard guard(expert_ids.device());
  const auto ids = expert_ids.contiguous();
  const int64_t slots = ids.numel();
  const int device = ids.get_device();
  auto opts = ids.options().dtype(at::kInt);
  auto counts = at::empty({num_experts}, opts);
  auto offsets = at::empty({num_experts + 1}, opts);
  auto permutation = at::empty({slots}, opts);
  auto inverse = at::empty({slots}, opts);
  auto workspace = at::empty({kernels::moe_group_workspace_ints(slots, static_cast<int>(num_experts), device)}, opts);
  kernels::MoeGroupParams p;
  p.expert_ids = ids.data_ptr();
  p.ids_int64 = ids.scalar_type() == at::kLong;
  p.num_slots = slots;
  p.num_experts = static_cast<int>(num_experts);
  p.counts = counts.data_ptr<int32_t>();
  p.offsets = offsets.data_ptr<int32_t>();
  p.permutation = permutation.data_ptr<int32_t>();
  p.inverse = inverse.data_ptr<int32_t>();
  p.workspace = workspace.data_ptr<int32_t>();
  check_launch(kernels::launch_moe_group(p, device, c10::cuda::getCurrentCUDAStream()), "moe_group");
  return {counts, offsets, permutation, inverse};
}

// The kernels read raw pointers: every tensor they touch is held contiguous for the launch.
at::Tensor moe_permute_cuda(const at::Tensor& x, const at::Tensor& permutation, const at::Tensor& offsets,
                            int64_t top_k, const std::optional<at::Tensor>& slot_scale) {
  check_device(x, "moe_permute", "x", c10::DeviceType::CUDA);
  check_permute_args(x, permutation, offsets, top_k, slot_scale);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous(), perm = permutation.contiguous(), offs = offsets.contiguous();
  const auto scale = slot_scale ? std::optional<at::Tensor>(slot_scale->contiguous()) : std::nullopt;
  auto out = at::empty({perm.numel(), x.size(1)}, x.options());
  kernels::MoePermuteParams p;
  p.x = xc.data_ptr();
  p.permutation = perm.data_ptr<int32_t>();
  p.offsets = offs.data_ptr<int32_t>();
  p.slot_scale = scale ? scale->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.num_slots = perm.numel();
  p.hidden = x.size(1);
  p.num_experts = static_cast<int>(offs.numel() - 1);
  p.top_k = static_cast<int>(top_k);
  p.type = element_type(x, "moe_permute");
  check_launch(kernels::launch_moe_permute(p, c10::cuda::getCurrentCUDAStream()), "moe_permute");
  return out;
}

at::Tensor moe_combine_cuda(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& offsets, int64_t top_k,
                            const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& bias) {
  check_device(y, "moe_combine", "y", c10::DeviceType::CUDA);
  check_combine_args(y, inverse, offsets, top_k, weights, bias);
  const c10::cuda::CUDAGuard guard(y.device());
  const auto yc = y.contiguous(), inv = inverse.contiguous(), offs = offsets.contiguous();
  const auto w = weights ? std::optional<at::Tensor>(weights->contiguous()) : std::nullopt;
  const auto b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  auto out = at::empty({inv.numel() / top_k, y.size(1)}, y.options());
  kernels::MoeCombineParams p;
  p.y = yc.data_ptr();
  p.inverse = inv.data_ptr<int32_t>();
  p.offsets = offs.data_ptr<int32_t>();
  p.weights = w ? w->data_ptr() : nullptr;
  p.bias = b ? b->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.num_tokens = inv.numel() / top_k;
  p.hidden = y.size(1);
  p.num_experts = static_cast<int>(offs.numel() - 1);
  p.top_k = static_cast<int>(top_k);
  p.type = element_type(y, "moe_combine");
  check_launch(kernels::launch_moe_combine(p, c10::cuda::getCurrentCUDAStream()), "moe_combine");
  return out;
}

at::Tensor moe_combine_weight_grad_cuda(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& inverse,
                                        const at::Tensor& offsets, int64_t top_k,
                                        const std::optional<at::Tensor>& bias) {
  check_device(y, "moe_combine_weight_grad", "y", c10::DeviceType::CUDA);
  check_weight_grad_args(grad_out, y, inverse, offsets, top_k, bias);
  const c10::cuda::CUDAGuard guard(y.device());
  const auto g = grad_out.contiguous(), yc = y.contiguous(), inv = inverse.contiguous(), offs = offsets.contiguous();
  const auto b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  auto out = at::empty({inv.numel() / top_k, top_k}, y.options());
  kernels::MoeCombineWeightGradParams p;
  p.grad_out = g.data_ptr();
  p.y = yc.data_ptr();
  p.inverse = inv.data_ptr<int32_t>();
  p.offsets = offs.data_ptr<int32_t>();
  p.grad_weights = out.data_ptr();
  p.bias = b ? b->data_ptr() : nullptr;
  p.num_tokens = inv.numel() / top_k;
  p.hidden = y.size(1);
  p.num_experts = static_cast<int>(offs.numel() - 1);
  p.top_k = static_cast<int>(top_k);
  p.type = element_type(y, "moe_combine_weight_grad");
  check_launch(kernels::launch_moe_combine_weight_grad(p, c10::cuda::getCurrentCUDAStream()),
               "moe_combine_weight_grad");
  return out;
}

kernels::MoeRouteSpec route_spec(int64_t experts, int64_t top_k, const std::string& scoring, bool renormalize,
                                 double renorm_epsilon, double scale, int64_t num_groups, int64_t top_groups,
                                 const std::string& group_score, double masked_choice) {
  kernels::MoeRouteSpec s;
  s.num_experts = static_cast<int>(experts);
  s.top_k = static_cast<int>(top_k);
  s.scoring = scoring == "softmax"   ? kernels::RouteScoring::kSoftmax
              : scoring == "sigmoid" ? kernels::RouteScoring::kSigmoid
                                     : kernels::RouteScoring::kTopkSoftmax;
  s.num_groups = static_cast<int>(num_groups);
  s.top_groups = static_cast<int>(num_groups > 1 ? top_groups : 1);
  s.group_score = group_score == "max" ? kernels::GroupScore::kMax : kernels::GroupScore::kTop2Sum;
  s.masked_choice = static_cast<float>(masked_choice);
  s.renormalize = renormalize;
  s.renorm_epsilon = static_cast<float>(renorm_epsilon);
  s.scale = static_cast<float>(scale);
  return s;
}

std::tuple<at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& logits, int64_t top_k, c10::string_view scoring,
                                                  bool renormalize, double renorm_epsilon, double scale,
                                                  int64_t num_groups, int64_t top_groups,
                                                  c10::string_view group_score, double masked_choice,
                                                  const std::optional<at::Tensor>& selection_bias) {
  const std::string scoring_name(scoring), group_name(group_score);
  check_device(logits, "moe_route", "logits", c10::DeviceType::CUDA);
  check_route_args("moe_route", logits, top_k, scoring_name, num_groups, top_groups, group_name, selection_bias);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto lc = logits.contiguous();
  const auto bias = selection_bias ? std::optional<at::Tensor>(selection_bias->contiguous()) : std::nullopt;
  auto weights = at::empty({lc.size(0), top_k}, lc.options().dtype(at::kFloat));
  auto ids = at::empty({lc.size(0), top_k}, lc.options().dtype(at::kLong));
  kernels::MoeRouteParams p;
  p.logits = lc.data_ptr();
  p.type = element_type(lc, "moe_route");
  p.logits_stride = lc.size(1);
  p.selection_bias = bias ? bias->data_ptr() : nullptr;
  p.bias_type = bias ? element_type(*bias, "moe_route") : kernels::ElementType::kFloat32;
  p.num_tokens = lc.size(0);
  p.spec = route_spec(lc.size(1), top_k, scoring_name, renormalize, renorm_epsilon, scale, num_groups, top_groups,
                      group_name, masked_choice);
  p.weights = weights.data_ptr<float>();
  p.ids = ids.data_ptr<int64_t>();
  check_launch(kernels::launch_moe_route(p, c10::cuda::getCurrentCUDAStream()), "moe_route");
  return {weights, ids};
}

at::Tensor moe_route_backward_cuda(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids,
                                   int64_t top_k, c10::string_view scoring, bool renormalize, double renorm_epsilon,
                                   double scale, int64_t num_groups, int64_t top_groups, c10::string_view group_score,
                                   double masked_choice, const std::optional<at::Tensor>& selection_bias) {
  const std::string scoring_name(scoring), group_name(group_score);
  check_device(logits, "moe_route_backward", "logits", c10::DeviceType::CUDA);
  check_route_args("moe_route_backward", logits, top_k, scoring_name, num_groups, top_groups, group_name,
                   selection_bias);
  check_route_backward_args(grad_weights, logits, ids, top_k);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto lc = logits.contiguous(), g = grad_weights.contiguous(), idc = ids.contiguous();
  const auto bias = selection_bias ? std::optional<at::Tensor>(selection_bias->contiguous()) : std::nullopt;
  auto grad_logits = at::empty_like(lc);
  kernels::MoeRouteBackwardParams p;
  p.grad_weights = g.data_ptr<float>();
  p.logits = lc.data_ptr();
  p.type = element_type(lc, "moe_route_backward");
  p.logits_stride = lc.size(1);
  p.selection_bias = bias ? bias->data_ptr() : nullptr;
  p.bias_type = bias ? element_type(*bias, "moe_route_backward") : kernels::ElementType::kFloat32;
  p.ids = idc.data_ptr<int64_t>();
  p.grad_logits = grad_logits.data_ptr();
  p.num_tokens = lc.size(0);
  p.spec = route_spec(lc.size(1), top_k, scoring_name, renormalize, renorm_epsilon, scale, num_groups, top_groups,
                      group_name, masked_choice);
  check_launch(kernels::launch_moe_route_backward(p, c10::cuda::getCurrentCUDAStream()), "moe_route_backward");
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("moe_group", &moe_group_cuda);
  m.impl("moe_permute", &moe_permute_cuda);
  m.impl("moe_combine", &moe_combine_cuda);
  m.impl("moe_combine_weight_grad", &moe_combine_weight_grad_cuda);
  m.impl("moe_route", &moe_route_cuda);
  m.impl("moe_route_backward", &moe_route_backward_cuda);
}

}  // namespace hasten
