// CPU reference of hasten::rms_norm, add_rms_norm and rms_norm_backward (the CUDA kernels' contract).
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "norm_checks.h"

namespace hasten {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight, double eps,
                                                double offset) {
  check_device(x_in, "rms_norm", "x", c10::DeviceType::CPU);
  check_rms_norm_args("rms_norm", x_in, weight);
  const auto x = x_in.contiguous();
  const auto w = weight.contiguous();
  const int64_t hidden = x.size(-1), rows = rows_of(x);
  auto y = at::empty_like(x);
  auto rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    float* rp = rstd.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      double squares = 0;
      for (int64_t c = 0; c < hidden; ++c) squares += double(xp[r * hidden + c]) * double(xp[r * hidden + c]);
      const float rs = static_cast<float>(1.0 / std::sqrt(squares / hidden + eps));
      rp[r] = rs;
      for (int64_t c = 0; c < hidden; ++c) {
        const float normalised = static_cast<float>(static_cast<scalar_t>(float(xp[r * hidden + c]) * rs));
        yp[r * hidden + c] = static_cast<scalar_t>((float(wp[c]) + float(offset)) * normalised);
      }
    }
  });
  return {y, rstd};
}

// x + residual (rounded to x's dtype, as the separate add gives it), then rms_norm of that sum.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& weight, double eps, double offset) {
  check_device(x, "add_rms_norm", "x", c10::DeviceType::CPU);
  check_add_rms_norm_args(x, residual, weight);
  const auto sum = at::add(x, residual).contiguous();
  auto [y, rstd] = rms_norm_cpu(sum, weight, eps, offset);
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                         const at::Tensor& weight, const at::Tensor& rstd_in,
                                                         double offset, bool weight_grad,
                                                         const std::optional<at::Tensor>& grad_add_in) {
  check_device(x_in, "rms_norm_backward", "x", c10::DeviceType::CPU);
  check_rms_norm_backward_args(grad_y_in, x_in, weight, rstd_in);
  if (grad_add_in) check_grad_add(*grad_add_in, x_in);
  const auto x = x_in.contiguous(), g = grad_y_in.contiguous(), w = weight.contiguous(), rstd = rstd_in.contiguous();
  const auto grad_add = grad_add_in ? grad_add_in->contiguous() : at::Tensor();
  const int64_t hidden = x.size(-1), rows = rows_of(x);
  auto grad_x = at::empty_like(x);
  auto grad_w = at::zeros({hidden}, x.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_backward_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const float* rp = rstd.data_ptr<float>();
    scalar_t* gx = grad_x.data_ptr<scalar_t>();
    const scalar_t* ga = grad_add.defined() ? grad_add.data_ptr<scalar_t>() : nullptr;
    double* gw = grad_w.data_ptr<double>();
    for (int64_t r = 0; r < rows; ++r) {
      const double rs = rp[r];
      double dot = 0;
      for (int64_t c = 0; c < hidden; ++c)
        dot += (double(wp[c]) + offset) * double(gp[r * hidden + c]) * double(xp[r * hidden + c]) * rs;
      const double mean_dot = dot / hidden;
      for (int64_t c = 0; c < hidden; ++c) {
        const double n = double(xp[r * hidden + c]) * rs, gy = double(gp[r * hidden + c]);
        const double add = ga ? double(ga[r * hidden + c]) : 0.0;  // the sum's other gradient, one rounding
        gx[r * hidden + c] = static_cast<scalar_t>(rs * ((double(wp[c]) + offset) * gy - n * mean_dot) + add);
        if (weight_grad) gw[c] += gy * double(static_cast<scalar_t>(static_cast<float>(n)));
      }
    }
  });
  if (!weight_grad) return {grad_x, at::empty({0}, weight.options())};
  return {grad_x, grad_w.to(weight.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace hasten
