// CPU references of hasten::moe_permute, moe_combine and moe_combine_weight_grad:
// plain row loops with float (double for float64) accumulation.
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "moe_checks.h"

namespace hasten {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The expert of sorted position pos: the first e with offsets[e + 1] > pos (offsets (E + 1,)).
int64_t expert_of_position(const int32_t* offsets, int64_t experts, int64_t pos) {
  return std::upper_bound(offsets + 1, offsets + 1 + experts, static_cast<int32_t>(pos)) - (offsets + 1);
}

// Row pos of y as the combine reads it: y[pos] + bias[its expert] rounded to scalar_t (the model's
// `y + bias` in its dtype) where a bias is given, else y[pos].
template <typename scalar_t>
void combined_row(const scalar_t* rows, const std::optional<at::Tensor>& bias, const int32_t* offsets,
                  int64_t experts, int64_t pos, int64_t hidden, std::vector<acc_t<scalar_t>>& out) {
  const scalar_t* r = rows + pos * hidden;
  const scalar_t* b = bias ? bias->data_ptr<scalar_t>() + expert_of_position(offsets, experts, pos) * hidden : nullptr;
  for (int64_t h = 0; h < hidden; ++h) {
    out[h] = b ? static_cast<acc_t<scalar_t>>(static_cast<scalar_t>(static_cast<acc_t<scalar_t>>(r[h]) +
                                                                    static_cast<acc_t<scalar_t>>(b[h])))
               : static_cast<acc_t<scalar_t>>(r[h]);
  }
}

at::Tensor moe_permute_cpu(const at::Tensor& x, const at::Tensor& permutation, const at::Tensor& offsets,
                           int64_t top_k, const std::optional<at::Tensor>& slot_scale) {
  check_device(x, "moe_permute", "x", c10::DeviceType::CPU);
  check_permute_args(x, permutation, offsets, top_k, slot_scale);
  const int64_t slots = permutation.numel(), hidden = x.size(1), experts = offsets.numel() - 1;
  const auto xc = x.contiguous();
  const auto perm = permutation.contiguous();
  const int32_t valid = offsets[experts].item<int32_t>();
  auto out = at::zeros({slots, hidden}, x.options());
  std::optional<at::Tensor> scale;
  if (slot_scale.has_value()) scale = slot_scale->contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_permute_cpu", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int32_t* p = perm.data_ptr<int32_t>();
    for (int64_t pos = 0; pos < valid; ++pos) {
      const int64_t s = p[pos];
      const acc_t<scalar_t> w = scale ? static_cast<acc_t<scalar_t>>(scale->data_ptr<scalar_t>()[s]) : 1;
      for (int64_t h = 0; h < hidden; ++h)
        dst[pos * hidden + h] = static_cast<scalar_t>(w * static_cast<acc_t<scalar_t>>(src[(s / top_k) * hidden + h]));
    }
  });
  return out;
}

at::Tensor moe_combine_cpu(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& offsets, int64_t top_k,
                           const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& bias) {
  check_device(y, "moe_combine", "y", c10::DeviceType::CPU);
  check_combine_args(y, inverse, offsets, top_k, weights, bias);
  const int64_t slots = inverse.numel(), tokens = slots / top_k, hidden = y.size(1), experts = offsets.numel() - 1;
  const auto yc = y.contiguous();
  const auto inv = inverse.contiguous();
  const auto offs = offsets.contiguous();
  const int32_t valid = offs[experts].item<int32_t>();
  std::optional<at::Tensor> w, b;
  if (weights.has_value()) w = weights->contiguous();
  if (bias.has_value()) b = bias->contiguous();
  auto out = at::empty({tokens, hidden}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "moe_combine_cpu", [&] {
    const scalar_t* rows = yc.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int32_t* iv = inv.data_ptr<int32_t>();
    std::vector<acc_t<scalar_t>> acc(hidden), r(hidden);
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t s = t * top_k + j;
        if (iv[s] >= valid) continue;
        const acc_t<scalar_t> weight = w ? static_cast<acc_t<scalar_t>>(w->data_ptr<scalar_t>()[s]) : 1;
        combined_row<scalar_t>(rows, b, offs.data_ptr<int32_t>(), experts, iv[s], hidden, r);
        for (int64_t h = 0; h < hidden; ++h) acc[h] += weight * r[h];
      }
      for (int64_t h = 0; h < hidden; ++h) dst[t * hidden + h] = static_cast<scalar_t>(acc[h]);
    }
  });
  return out;
}

at::Tensor moe_combine_weight_grad_cpu(const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& inverse,
                                       const at::Tensor& offsets, int64_t top_k, const std::optional<at::Tensor>& bias) {
  check_device(y, "moe_combine_weight_grad", "y", c10::DeviceType::CPU);
  check_weight_grad_args(grad_out, y, inverse, offsets, top_k, bias);
  const int64_t slots = inverse.numel(), tokens = slots / top_k, hidden = y.size(1), experts = offsets.numel() - 1;
  const auto g = grad_out.contiguous();
  const auto yc = y.contiguous();
  const auto inv = inverse.contiguous();
  const auto offs = offsets.contiguous();
  const int32_t valid = offs[experts].item<int32_t>();
  std::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  auto out = at::zeros({tokens, top_k}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "moe_combine_weight_grad_cpu", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* rows = yc.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    const int32_t* iv = inv.data_ptr<int32_t>();
    std::vector<acc_t<scalar_t>> r(hidden);
    for (int64_t s = 0; s < slots; ++s) {
      if (iv[s] >= valid) continue;
      combined_row<scalar_t>(rows, b, offs.data_ptr<int32_t>(), experts, iv[s], hidden, r);
      acc_t<scalar_t> acc = 0;
      for (int64_t h = 0; h < hidden; ++h) acc += static_cast<acc_t<scalar_t>>(gp[(s / top_k) * hidden + h]) * r[h];
      dst[s] = static_cast<scalar_t>(acc);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("moe_permute", &moe_permute_cpu);
  m.impl("moe_combine", &moe_combine_cpu);
  m.impl("moe_combine_weight_grad", &moe_combine_weight_grad_cpu);
}

}  // namespace hasten
