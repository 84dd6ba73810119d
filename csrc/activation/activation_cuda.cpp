// CUDA glue of the SwiGLU ops: checks, device guard, one launch each on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

#include "../kernels/swiglu.cuh"
#include "activation_checks.h"
#include "hasten/cuda_glue.h"

namespace hasten {
namespace {

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
                          inner, rows, inner, element_type(x, "swiglu")};
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
                          element_type(x, "swiglu_backward")};
  check_launch(kernels::launch_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()), "swiglu_backward");
  return out;
}

at::Tensor silu_mul_cuda(const at::Tensor& gate, const at::Tensor& up) {
  check_device(gate, "silu_mul", "gate", c10::DeviceType::CUDA);
  check_silu_mul_args("silu_mul", gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto g = gate.contiguous(), u = up.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto out = at::empty_like(g);
  kernels::SwigluParams p{g.data_ptr(), u.data_ptr(), inner, nullptr, out.data_ptr(), nullptr, inner, rows, inner,
                          element_type(g, "silu_mul")};
  check_launch(kernels::launch_swiglu_forward(p, c10::cuda::getCurrentCUDAStream()), "silu_mul");
  return out;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cuda(const at::Tensor& grad_act, const at::Tensor& gate,
                                                           const at::Tensor& up) {
  check_device(gate, "silu_mul_backward", "gate", c10::DeviceType::CUDA);
  check_silu_mul_backward_args(grad_act, gate, up);
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto g = gate.contiguous(), u = up.contiguous(), d = grad_act.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto grad_gate = at::empty_like(g), grad_up = at::empty_like(u);
  kernels::SwigluParams p{g.data_ptr(), u.data_ptr(), inner, d.data_ptr(), grad_gate.data_ptr(), grad_up.data_ptr(),
                          inner, rows, inner, element_type(g, "silu_mul_backward")};
  check_launch(kernels::launch_swiglu_backward(p, c10::cuda::getCurrentCUDAStream()), "silu_mul_backward");
  return {grad_gate, grad_up};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("silu_mul_backward", &silu_mul_backward_cuda);
}

}  // namespace hasten
