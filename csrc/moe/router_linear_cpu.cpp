// CPU reference of hasten::router_linear and its backward (registration.cpp states what they
// compute): the models' own expression, `F.linear(x.type(torch.float32), weight.type(torch.float32))`,
// and its gradients cast back to the inputs' types, on ATen's float32 GEMM.
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

#include "moe_checks.h"

namespace hasten {
namespace {

at::Tensor router_linear_cpu(const at::Tensor& x, const at::Tensor& weight) {
  check_device(x, "router_linear", "x", c10::DeviceType::CPU);
  check_router_linear_args("router_linear", x, weight);
  return at::linear(x.to(at::kFloat), weight.to(at::kFloat));
}

std::tuple<at::Tensor, at::Tensor> router_linear_backward_cpu(const at::Tensor& grad_logits, const at::Tensor& x,
                                                              const at::Tensor& weight, bool x_grad,
                                                              bool weight_grad) {
  check_device(x, "router_linear_backward", "x", c10::DeviceType::CPU);
  check_router_linear_backward_args(grad_logits, x, weight);
  // (T, E) @ (E, H) and (E, T) @ (T, H) in float32, each rounded once to its input's type
  at::Tensor grad_x = x_grad ? at::mm(grad_logits, weight.to(at::kFloat)).to(x.scalar_type()) : x.new_empty({0});
  at::Tensor grad_weight =
      weight_grad ? at::mm(grad_logits.t(), x.to(at::kFloat)).to(weight.scalar_type()) : weight.new_empty({0});
  return {grad_x, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("router_linear", &router_linear_cpu);
  m.impl("router_linear_backward", &router_linear_backward_cpu);
}

}  // namespace hasten
