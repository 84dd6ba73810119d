// CUDA glue of hasten::rms_norm, add_rms_norm and rms_norm_backward: checks, device guard, one launch each
// (plus the column sums of the backward's per-block weight-gradient partials: weight_grad_cuda.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <optional>
#include <tuple>

#include "../kernels/rms_norm.cuh"
#include "hasten/cuda_glue.h"
#include "norm_checks.h"
#include "weight_grad_cuda.h"

namespace hasten {
namespace {

// One forward launch: y = rms_norm(x), or with a residual y = rms_norm(x + residual) and the sum.
// Returns (y, sum (undefined without a residual), rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const char* op, const at::Tensor& x_in,
                                                       const at::Tensor* residual_in, const at::Tensor& weight,
                                                       double eps, double offset) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous(), w = weight.contiguous();
  const auto residual = residual_in ? residual_in->contiguous() : at::Tensor();
  const int64_t hidden = x.size(-1), rows = rows_of(x);
  auto y = at::empty_like(x);
  auto sum = residual_in ? at::empty_like(x) : at::Tensor();
  auto rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  kernels::RmsNormParams p{};
  p.x = x.data_ptr();
  p.residual = residual_in ? residual.data_ptr() : nullptr;
  p.sum = residual_in ? sum.data_ptr() : nullptr;
  p.weight = w.data_ptr();
  p.y = y.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  p.rows = rows;
  p.hidden = hidden;
  p.eps = static_cast<float>(eps);
  p.offset = static_cast<float>(offset);
  p.type = element_type(x, op);
  check_launch(kernels::launch_rms_norm_forward(p, c10::cuda::getCurrentCUDAStream()), op);
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cuda(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                 double offset) {
  check_device(x, "rms_norm", "x", c10::DeviceType::CUDA);
  check_rms_norm_args("rms_norm", x, weight);
  auto [y, unused_sum, rstd] = forward("rms_norm", x, nullptr, weight, eps, offset);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                 const at::Tensor& weight, double eps, double offset) {
  check_device(x, "add_rms_norm", "x", c10::DeviceType::CUDA);
  check_add_rms_norm_args(x, residual, weight);
  return forward("add_rms_norm", x, &residual, weight, eps, offset);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                          const at::Tensor& weight, const at::Tensor& rstd_in,
                                                          double offset, bool weight_grad,
                                                          const std::optional<at::Tensor>& grad_add_in) {
  check_device(x_in, "rms_norm_backward", "x", c10::DeviceType::CUDA);
  check_rms_norm_backward_args(grad_y_in, x_in, weight, rstd_in);
  if (grad_add_in) check_grad_add(*grad_add_in, x_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous(), g = grad_y_in.contiguous(), w = weight.contiguous(), rstd = rstd_in.contiguous();
  const auto grad_add = grad_add_in ? grad_add_in->contiguous() : at::Tensor();
  const int64_t hidden = x.size(-1), rows = rows_of(x);
  const int blocks = kernels::rms_norm_backward_blocks(rows, x.get_device());
  auto grad_x = at::empty_like(x);
  auto partial = weight_grad ? at::empty({blocks, hidden}, x.options().dtype(at::kFloat)) : at::Tensor();
  kernels::RmsNormParams p{};
  p.x = x.data_ptr();
  p.weight = w.data_ptr();
  p.grad_y = g.data_ptr();
  p.y = grad_x.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  p.grad_weight_partial = weight_grad ? partial.data_ptr<float>() : nullptr;
  p.grad_add = grad_add.defined() ? grad_add.data_ptr() : nullptr;
  p.rows = rows;
  p.hidden = hidden;
  p.offset = static_cast<float>(offset);
  p.type = element_type(x, "rms_norm_backward");
  check_launch(kernels::launch_rms_norm_backward(p, blocks, c10::cuda::getCurrentCUDAStream()), "rms_norm_backward");
  if (!weight_grad) return {grad_x, at::empty({0}, weight.options())};
  return {grad_x, summed_weight_grad(partial, weight, "rms_norm_backward")};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace hasten
