// CPU reference of hasten::swiglu and swiglu_backward on [gate | up] rows.
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>

#include "moe_checks.h"

namespace hasten {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

at::Tensor swiglu_cpu(const at::Tensor& gate_up) {
  check_swiglu_args("swiglu", gate_up);
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inner; ++c) {
        const A g = static_cast<A>(in[r * 2 * inner + c]), u = static_cast<A>(in[r * 2 * inner + inner + c]);
        o[r * inner + c] = static_cast<scalar_t>(g / (A(1) + std::exp(-g)) * u);
      }
  });
  return out;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_act, const at::Tensor& gate_up) {
  check_swiglu_backward_args(grad_act, gate_up);
  const auto x = gate_up.contiguous();
  const auto d = grad_act.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_backward_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inner; ++c) {
        const A g = static_cast<A>(in[r * 2 * inner + c]), u = static_cast<A>(in[r * 2 * inner + inner + c]);
        const A da = static_cast<A>(dp[r * inner + c]);
        const A sg = A(1) / (A(1) + std::exp(-g));
        o[r * 2 * inner + c] = static_cast<scalar_t>(da * u * sg * (A(1) + g * (A(1) - sg)));
        o[r * 2 * inner + inner + c] = static_cast<scalar_t>(da * g * sg);
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
}

}  // namespace hasten
