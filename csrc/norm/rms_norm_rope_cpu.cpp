// CPU reference of hasten::rms_norm_rope and its backward: the two ops it fuses, one after the
// other (hasten::rms_norm, then hasten::rope; backward rope's transpose, then rms_norm_backward).
// That is the contract the CUDA kernel keeps (kernels/rms_norm_rope.cuh), so on the CPU the fused
// op and the two separate ops give the same values by construction.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <tuple>

#include "norm_checks.h"

namespace hasten {
namespace {

using NormPair = std::tuple<at::Tensor, at::Tensor>;

const c10::TypedOperatorHandle<NormPair(const at::Tensor&, const at::Tensor&, double, double)>& norm_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hasten::rms_norm", "")
                             .typed<NormPair(const at::Tensor&, const at::Tensor&, double, double)>();
  return op;
}

const c10::TypedOperatorHandle<NormPair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        double, bool, const std::optional<at::Tensor>&)>&
norm_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("hasten::rms_norm_backward", "")
                             .typed<NormPair(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, double, bool, const std::optional<at::Tensor>&)>();
  return op;
}

const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>&
rope_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hasten::rope", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>();
  return op;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rope_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                     const at::Tensor& cos, const at::Tensor& sin, double eps,
                                                     double offset, bool interleaved) {
  check_device(x, "rms_norm_rope", "x", c10::DeviceType::CPU);
  check_rms_norm_rope_args("rms_norm_rope", x, weight, cos, sin);
  // y (B, H, L, D) and rstd (B, H, L), both contiguous: the norm reads x's rows in that order
  auto [y, rstd] = norm_op().call(x, weight, eps, offset);
  auto out = at::empty_like(x);  // x's strides, as the CUDA op gives them
  out.copy_(rope_op().call(y, cos, sin, false, interleaved));
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rope_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                              const at::Tensor& weight, const at::Tensor& rstd,
                                                              const at::Tensor& cos, const at::Tensor& sin,
                                                              double offset, bool interleaved, bool weight_grad) {
  check_device(x, "rms_norm_rope_backward", "x", c10::DeviceType::CPU);
  check_rms_norm_rope_backward_args(grad_out, x, weight, rstd, cos, sin);
  const auto grad_y = rope_op().call(grad_out, cos, sin, true, interleaved);  // rounded to x's dtype
  auto [grad_norm, grad_weight] =
      norm_backward_op().call(grad_y, x, weight, rstd.contiguous(), offset, weight_grad, std::nullopt);
  auto grad_x = at::empty_like(x);
  grad_x.copy_(grad_norm);
  return {grad_x, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("rms_norm_rope", &rms_norm_rope_cpu);
  m.impl("rms_norm_rope_backward", &rms_norm_rope_backward_cpu);
}

}  // namespace hasten
