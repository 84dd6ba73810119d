// CUDA glue of the gated-MLP ops (SwiGLU, GeGLU-tanh): checks, device guard, one launch each on
// the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../kernels/swiglu.cuh"
#include "activation_checks.h"
#include "hasten/cuda_glue.h"

namespace hasten {
namespace {

using kernels::GateActivation;

// The kernels read raw pointers: every tensor they touch is held contiguous for the launch.
at::Tensor swiglu_cuda(const at::Tensor& gate_up) {
  check_device(gate_up, "swiglu", "gate_up", c10::DeviceType::CUDA);
  check_swiglu_args("swiglu", gate_up);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  const char* base = static_cast<const char*>(x.data_ptr());
  kernels::SwigluParams p{base, base + inner * x.element_size(), 2 * inner, nullptr, out.data_ptr(), nullptr,
                          inner, rows, inner, element_type(x, "swiglu"), GateActivation::kSilu};
  check_launch(kernels::launch_swiglu_forward(p, c10::cuda::getCurrentCUDAStream()), "swiglu");
  return out;
}

at::Tensor swiglu_backward_cuda(const at::Tensor& grad_act, const at::Tensor& gate_up) {
  check_device(gate_up, "swiglu_backward", "gate_up", c10::DeviceType::CUDA);
  check_swiglu_backward_args(grad_act, gate_up);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto x = gate_up.contiguous();
  const auto d = grad_act.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty_like(x);
  const char* base = static_cast<const char*>(x.data_ptr());
  char* out_base = static_cast<char*>(out.data_ptr());
  kernels::SwigluParams p{base, base + inner * x.element_size(), 2 * inner, d.data_ptr(), out_base,
                          out_base + inner * out.element_size(), 2 * inner, rows, inner,
                          element_type(x, "swiglu_backward"), GateActivation::kSilu};
  check_launch(kernels::launch_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()), "swiglu_backward");
  return out;
}

// The MoE experts' SwiGLU with the router's weights folded in (kernels/swiglu.cuh).
struct WeightedSwigluInputs {
  at::Tensor gate_up, weights, permutation, offsets;
};

WeightedSwigluInputs weighted_swiglu_inputs(const at::Tensor& gate_up, const at::Tensor& weights,
                                            const at::Tensor& permutation, const at::Tensor& offsets) {
  return {gate_up.contiguous(), weights.contiguous(), permutation.contiguous(), offsets.contiguous()};
}

kernels::MoeWeightedSwigluParams weighted_swiglu_params(const WeightedSwigluInputs& in, const char* op) {
  kernels::MoeWeightedSwigluParams p{};
  p.gate_up = in.gate_up.data_ptr();
  p.weights = in.weights.data_ptr();
  p.permutation = in.permutation.data_ptr<int32_t>();
  p.valid_rows = in.offsets.data_ptr<int32_t>() + (in.offsets.numel() - 1);
  p.rows = in.gate_up.size(0);
  p.inner = in.gate_up.size(1) / 2;
  p.type = element_type(in.gate_up, op);
  return p;
}

at::Tensor moe_weighted_swiglu_cuda(const at::Tensor& gate_up, const at::Tensor& weights,
                                    const at::Tensor& permutation, const at::Tensor& offsets) {
  const char* op = "moe_weighted_swiglu";
  check_device(gate_up, op, "gate_up", c10::DeviceType::CUDA);
  check_weighted_swiglu_args(op, gate_up, weights, permutation, offsets);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto in = weighted_swiglu_inputs(gate_up, weights, permutation, offsets);
  auto out = at::empty({in.gate_up.size(0), in.gate_up.size(1) / 2}, in.gate_up.options());
  auto p = weighted_swiglu_params(in, op);
  p.out = out.data_ptr();
  check_launch(kernels::launch_moe_weighted_swiglu_forward(p, c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_weighted_swiglu_backward_cuda(const at::Tensor& grad_act,
                                                                     const at::Tensor& gate_up,
                                                                     const at::Tensor& weights,
                                                                     const at::Tensor& permutation,
                                                                     const at::Tensor& offsets) {
  const char* op = "moe_weighted_swiglu_backward";
  check_device(gate_up, op, "gate_up", c10::DeviceType::CUDA);
  check_weighted_swiglu_backward_args(grad_act, gate_up, weights, permutation, offsets);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto in = weighted_swiglu_inputs(gate_up, weights, permutation, offsets);
  const auto d = grad_act.contiguous();
  auto grad_gate_up = at::empty_like(in.gate_up);
  auto grad_weights = at::empty_like(in.weights);
  auto p = weighted_swiglu_params(in, op);
  p.grad_act = d.data_ptr();
  p.out = grad_gate_up.data_ptr();
  p.grad_weights = grad_weights.data_ptr();
  check_launch(kernels::launch_moe_weighted_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()), op);
  return {grad_gate_up, grad_weights};
}

// gpt-oss's clamped SwiGLU on interleaved (gate, up) pairs of one (R, 2I) tensor.
// The optional expert biases into the params; `held` keeps their contiguous copies alive for the launch.
void set_row_bias(kernels::ClampedSwigluParams& p, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& group_ends, std::vector<at::Tensor>& held) {
  if (!bias.has_value()) return;
  held = {bias->contiguous(), group_ends->contiguous()};
  p.bias = held[0].data_ptr();
  p.group_ends = held[1].data_ptr<int32_t>();
  p.experts = held[0].size(0);
}

at::Tensor clamped_swiglu_cuda(const at::Tensor& gate_up, double alpha, double limit,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& group_ends) {
  check_device(gate_up, "clamped_swiglu", "gate_up", c10::DeviceType::CUDA);
  check_clamped_swiglu_args("clamped_swiglu", gate_up, alpha, limit);
  check_clamped_swiglu_bias("clamped_swiglu", gate_up, bias, group_ends);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  kernels::ClampedSwigluParams p{x.data_ptr(), nullptr, out.data_ptr(), rows, inner, static_cast<float>(alpha),
                                 static_cast<float>(limit), element_type(x, "clamped_swiglu")};
  std::vector<at::Tensor> held;
  set_row_bias(p, bias, group_ends, held);
  check_launch(kernels::launch_clamped_swiglu_forward(p, c10::cuda::getCurrentCUDAStream()), "clamped_swiglu");
  return out;
}

at::Tensor clamped_swiglu_backward_cuda(const at::Tensor& grad_act, const at::Tensor& gate_up, double alpha,
                                        double limit, const std::optional<at::Tensor>& bias,
                                        const std::optional<at::Tensor>& group_ends) {
  check_device(gate_up, "clamped_swiglu_backward", "gate_up", c10::DeviceType::CUDA);
  check_clamped_swiglu_backward_args(grad_act, gate_up, alpha, limit);
  check_clamped_swiglu_bias("clamped_swiglu_backward", gate_up, bias, group_ends);
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const auto x = gate_up.contiguous();
  const auto d = grad_act.contiguous();
  auto out = at::empty_like(x);
  kernels::ClampedSwigluParams p{x.data_ptr(), d.data_ptr(), out.data_ptr(), x.size(0), x.size(1) / 2,
                                 static_cast<float>(alpha), static_cast<float>(limit),
                                 element_type(x, "clamped_swiglu_backward")};
  std::vector<at::Tensor> held;
  set_row_bias(p, bias, group_ends, held);
  check_launch(kernels::launch_clamped_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()),
               "clamped_swiglu_backward");
  return out;
}

// gate and up (..., inner) of one shape, as contiguous rows of `inner`: act = f(gate) * up.
at::Tensor gated_mul_cuda(const char* op, GateActivation activation, const at::Tensor& gate, const at::Tensor& up) {
  check_device(gate, op, "gate", c10::DeviceType::CUDA);
  check_gated_mul_args(op, gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto g = gate.contiguous(), u = up.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto out = at::empty_like(g);
  kernels::SwigluParams p{g.data_ptr(), u.data_ptr(), inner, nullptr, out.data_ptr(), nullptr, inner, rows, inner,
                          element_type(g, op), activation};
  check_launch(kernels::launch_swiglu_forward(p, c10::cuda::getCurrentCUDAStream()), op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> gated_mul_backward_cuda(const char* op, GateActivation activation,
                                                           const at::Tensor& grad_act, const at::Tensor& gate,
                                                           const at::Tensor& up) {
  check_device(gate, op, "gate", c10::DeviceType::CUDA);
  check_gated_mul_backward_args(op, grad_act, gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto g = gate.contiguous(), u = up.contiguous(), d = grad_act.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto grad_gate = at::empty_like(g), grad_up = at::empty_like(u);
  kernels::SwigluParams p{g.data_ptr(), u.data_ptr(), inner, d.data_ptr(), grad_gate.data_ptr(), grad_up.data_ptr(),
                          inner, rows, inner, element_type(g, op), activation};
  check_launch(kernels::launch_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()), op);
  return {grad_gate, grad_up};
}

at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  return gated_mul_cuda("silu_mul", GateActivation::kSilu, gate, up);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cuda(const at::Tensor& grad_act, const at::Tensor& gate,
                                                           const at::Tensor& up) {
  return gated_mul_backward_cuda("silu_mul_backward", GateActivation::kSilu, grad_act, gate, up);
}

at::Tensor gelu_tanh_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  return gated_mul_cuda("gelu_tanh_mul", GateActivation::kGeluTanh, gate, up);
}

std::tuple<at::Tensor, at::Tensor> gelu_tanh_mul_backward_cuda(const at::Tensor& grad_act, const at::Tensor& gate,
                                                                const at::Tensor& up) {
  return gated_mul_backward_cuda("gelu_tanh_mul_backward", GateActivation::kGeluTanh, grad_act, gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("silu_mul_backward", &silu_mul_backward_cuda);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul_cuda);
  m.impl("gelu_tanh_mul_backward", &gelu_tanh_mul_backward_cuda);
  m.impl("clamped_swiglu", &clamped_swiglu_cuda);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cuda);
  m.impl("moe_weighted_swiglu", &moe_weighted_swiglu_cuda);
  m.impl("moe_weighted_swiglu_backward", &moe_weighted_swiglu_backward_cuda);
}

}  // namespace hasten
