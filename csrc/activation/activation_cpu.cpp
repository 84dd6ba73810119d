// CPU reference of the gated-MLP ops (SwiGLU, GeGLU-tanh): one strided routine for both layouts
// (see activation_checks.h), parametrised by the gate's activation (kernels/gate_activation.h).
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "../kernels/gate_activation.h"
#include "activation_checks.h"

namespace hasten {
namespace {

using kernels::GateActivation;

// float math for float and the 16-bit types, double for double (the CUDA kernels compute in float)
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// f(g) and f'(g) of the gate activation.
template <typename A>
struct GateValue {
  A value, slope;
};

template <GateActivation F, typename A>
GateValue<A> gate_activation(A g) {
  if constexpr (F == GateActivation::kSilu) {
    const A sg = A(1) / (A(1) + std::exp(-g));
    return {g * sg, sg * (A(1) + g * (A(1) - sg))};
  } else {
    // torch's gelu(approximate="tanh") and its derivative (aten GeluBackward)
    const A sqrt_2_over_pi = A(0.7978845608028654), cubic = A(0.044715);
    const A t = std::tanh(sqrt_2_over_pi * (g + cubic * g * g * g));
    return {A(0.5) * g * (A(1) + t),
            A(0.5) * (A(1) + t) + A(0.5) * g * (A(1) - t * t) * sqrt_2_over_pi * (A(1) + A(3) * cubic * g * g)};
  }
}

// Rows of gate and up at a common stride `in_stride`; act (rows, inner) contiguous.
template <GateActivation F, typename T>
void gated_rows(const T* gate, const T* up, int64_t in_stride, T* act, int64_t rows, int64_t inner) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inner; ++c) {
      const A g = static_cast<A>(gate[r * in_stride + c]), u = static_cast<A>(up[r * in_stride + c]);
      act[r * inner + c] = static_cast<T>(gate_activation<F>(g).value * u);
    }
}

// grad_gate = grad_act * up * f'(gate), grad_up = grad_act * f(gate); both at `out_stride`.
template <GateActivation F, typename T>
void gated_rows_backward(const T* gate, const T* up, int64_t in_stride, const T* grad_act, T* grad_gate, T* grad_up,
                         int64_t out_stride, int64_t rows, int64_t inner) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < inner; ++c) {
      const A g = static_cast<A>(gate[r * in_stride + c]), u = static_cast<A>(up[r * in_stride + c]);
      const A d = static_cast<A>(grad_act[r * inner + c]);
      const GateValue<A> f = gate_activation<F>(g);
      grad_gate[r * out_stride + c] = static_cast<T>(d * u * f.slope);
      grad_up[r * out_stride + c] = static_cast<T>(d * f.value);
    }
}

at::Tensor swiglu_cpu(const at::Tensor& gate_up) {
  check_swiglu_args("swiglu", gate_up);
  const auto x = gate_up.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_cpu", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    gated_rows<GateActivation::kSilu>(in, in + inner, 2 * inner, out.data_ptr<scalar_t>(), rows, inner);
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
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    gated_rows_backward<GateActivation::kSilu>(in, in + inner, 2 * inner, d.data_ptr<scalar_t>(), o, o + inner,
                                               2 * inner, rows, inner);
  });
  return out;
}

// The MoE experts' SwiGLU with the router's weights folded in (kernels/swiglu.cuh has the formulas):
// act[p] = w[s] * (silu(gate[p]) * up[p]), s = permutation[p]; rows at p >= offsets[E] are zero.
at::Tensor moe_weighted_swiglu_cpu(const at::Tensor& gate_up, const at::Tensor& weights,
                                   const at::Tensor& permutation, const at::Tensor& offsets) {
  const char* op = "moe_weighted_swiglu";
  check_device(gate_up, op, "gate_up", c10::DeviceType::CPU);
  check_weighted_swiglu_args(op, gate_up, weights, permutation, offsets);
  const auto x = gate_up.contiguous(), w = weights.contiguous(), perm = permutation.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  const int64_t valid = std::min<int64_t>(offsets[-1].item<int32_t>(), rows);
  auto out = at::zeros({rows, inner}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_weighted_swiglu_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* ws = w.data_ptr<scalar_t>();
    const int32_t* slots = perm.data_ptr<int32_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < valid; ++r) {
      const A scale = static_cast<A>(ws[slots[r]]);
      for (int64_t c = 0; c < inner; ++c) {
        const A g = static_cast<A>(in[r * 2 * inner + c]), u = static_cast<A>(in[r * 2 * inner + inner + c]);
        o[r * inner + c] = static_cast<scalar_t>(scale * (gate_activation<GateActivation::kSilu>(g).value * u));
      }
    }
  });
  return out;
}

// -> (d gate_up, d weights): SwiGLU's backward of w[s] * grad_act[p], d w[s] = sum over the row of
// silu(gate) * up * grad_act in the accumulation type, columns in order; zeros for dropped slots.
std::tuple<at::Tensor, at::Tensor> moe_weighted_swiglu_backward_cpu(const at::Tensor& grad_act,
                                                                    const at::Tensor& gate_up,
                                                                    const at::Tensor& weights,
                                                                    const at::Tensor& permutation,
                                                                    const at::Tensor& offsets) {
  const char* op = "moe_weighted_swiglu_backward";
  check_device(gate_up, op, "gate_up", c10::DeviceType::CPU);
  check_weighted_swiglu_backward_args(grad_act, gate_up, weights, permutation, offsets);
  const auto x = gate_up.contiguous(), w = weights.contiguous(), perm = permutation.contiguous();
  const auto d = grad_act.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  const int64_t valid = std::min<int64_t>(offsets[-1].item<int32_t>(), rows);
  auto grad_gate_up = at::zeros_like(x);
  auto grad_weights = at::zeros_like(w);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_weighted_swiglu_backward_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* ws = w.data_ptr<scalar_t>();
    const scalar_t* grad = d.data_ptr<scalar_t>();
    const int32_t* slots = perm.data_ptr<int32_t>();
    scalar_t* o = grad_gate_up.data_ptr<scalar_t>();
    scalar_t* gw = grad_weights.data_ptr<scalar_t>();
    for (int64_t r = 0; r < valid; ++r) {
      const A scale = static_cast<A>(ws[slots[r]]);
      A dot = 0;
      for (int64_t c = 0; c < inner; ++c) {
        const A g = static_cast<A>(in[r * 2 * inner + c]), u = static_cast<A>(in[r * 2 * inner + inner + c]);
        const A dg = static_cast<A>(grad[r * inner + c]);
        const GateValue<A> f = gate_activation<GateActivation::kSilu>(g);
        dot += f.value * u * dg;
        const A ds = scale * dg;
        o[r * 2 * inner + c] = static_cast<scalar_t>(ds * u * f.slope);
        o[r * 2 * inner + inner + c] = static_cast<scalar_t>(ds * f.value);
      }
      gw[slots[r]] = static_cast<scalar_t>(dot);
    }
  });
  return {grad_gate_up, grad_weights};
}

// gpt-oss's clamped SwiGLU on interleaved (gate, up) pairs (kernels/swiglu.cuh has the formulas).
template <typename A>
struct ClampedGate {
  A g, u, s, glu;
  bool gate_passes, up_passes;
};

template <typename A>
ClampedGate<A> clamped_gate(A gate, A up, A alpha, A limit) {
  ClampedGate<A> c;
  c.gate_passes = gate <= limit;
  c.up_passes = up >= -limit && up <= limit;
  c.g = std::min(gate, limit);
  c.u = std::min(std::max(up, -limit), limit);
  c.s = A(1) / (A(1) + std::exp(-(c.g * alpha)));
  c.glu = c.g * c.s;
  return c;
}

// gate_up with each row's expert bias added and rounded to its dtype (the model adds the bias in its
// dtype), where given; kernels/swiglu.cuh's ClampedSwigluParams has the row-to-expert rule.
at::Tensor with_row_bias(const at::Tensor& gate_up, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& group_ends) {
  if (!bias.has_value()) return gate_up.contiguous();
  const auto ends = group_ends->contiguous();
  const int32_t* end = ends.data_ptr<int32_t>();
  const int64_t experts = ends.size(0), rows = gate_up.size(0);
  std::vector<int64_t> expert_of_row(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t e = std::upper_bound(end, end + experts, static_cast<int32_t>(std::min<int64_t>(r, INT32_MAX))) - end;
    expert_of_row[r] = std::min(e, experts - 1);
  }
  const auto index = at::tensor(expert_of_row, gate_up.options().dtype(at::kLong));
  // in float32 (float64 inputs: float64), then rounded once to gate_up's dtype, as the CUDA kernel does
  const auto wide = gate_up.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return (gate_up.to(wide) + bias->index_select(0, index).to(wide)).to(gate_up.scalar_type()).contiguous();
}

at::Tensor clamped_swiglu_cpu(const at::Tensor& gate_up, double alpha, double limit,
                              const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& group_ends) {
  check_clamped_swiglu_args("clamped_swiglu", gate_up, alpha, limit);
  check_clamped_swiglu_bias("clamped_swiglu", gate_up, bias, group_ends);
  const auto x = with_row_bias(gate_up, bias, group_ends);
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty({rows, inner}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clamped_swiglu_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* act = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inner; ++c) {
        const auto g = clamped_gate<A>(static_cast<A>(in[r * 2 * inner + 2 * c]),
                                       static_cast<A>(in[r * 2 * inner + 2 * c + 1]), A(alpha), A(limit));
        act[r * inner + c] = static_cast<scalar_t>((g.u + A(1)) * g.glu);
      }
  });
  return out;
}

at::Tensor clamped_swiglu_backward_cpu(const at::Tensor& grad_act, const at::Tensor& gate_up, double alpha,
                                       double limit, const std::optional<at::Tensor>& bias,
                                       const std::optional<at::Tensor>& group_ends) {
  check_clamped_swiglu_backward_args(grad_act, gate_up, alpha, limit);
  check_clamped_swiglu_bias("clamped_swiglu_backward", gate_up, bias, group_ends);
  const auto x = with_row_bias(gate_up, bias, group_ends);
  const auto d = grad_act.contiguous();
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "clamped_swiglu_backward_cpu", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* grad = d.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < inner; ++c) {
        const int64_t at = r * 2 * inner + 2 * c;
        const auto g = clamped_gate<A>(static_cast<A>(in[at]), static_cast<A>(in[at + 1]), A(alpha), A(limit));
        const A df = static_cast<A>(grad[r * inner + c]);
        const A slope = g.s + g.g * g.s * (A(1) - g.s) * A(alpha);
        o[at] = static_cast<scalar_t>(g.gate_passes ? df * (g.u + A(1)) * slope : A(0));
        o[at + 1] = static_cast<scalar_t>(g.up_passes ? df * g.glu : A(0));
      }
  });
  return out;
}

// gate and up (..., inner) of one shape, read as contiguous rows of `inner`.
template <GateActivation F>
at::Tensor gated_mul_cpu(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_gated_mul_args(op, gate, up);
  const auto g = gate.contiguous(), u = up.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto out = at::empty_like(g);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "gated_mul_cpu", [&] {
    gated_rows<F>(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), inner, out.data_ptr<scalar_t>(), rows, inner);
  });
  return out;
}

template <GateActivation F>
std::tuple<at::Tensor, at::Tensor> gated_mul_backward_cpu(const char* op, const at::Tensor& grad_act,
                                                          const at::Tensor& gate, const at::Tensor& up) {
  check_gated_mul_backward_args(op, grad_act, gate, up);
  const auto g = gate.contiguous(), u = up.contiguous(), d = grad_act.contiguous();
  const int64_t inner = g.size(-1), rows = rows_of(g);
  auto grad_gate = at::empty_like(g), grad_up = at::empty_like(u);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "gated_mul_backward_cpu", [&] {
    gated_rows_backward<F>(g.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), inner, d.data_ptr<scalar_t>(),
                           grad_gate.data_ptr<scalar_t>(), grad_up.data_ptr<scalar_t>(), inner, rows, inner);
  });
  return {grad_gate, grad_up};
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return gated_mul_cpu<GateActivation::kSilu>("silu_mul", gate, up);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_cpu(const at::Tensor& grad_act, const at::Tensor& gate,
                                                          const at::Tensor& up) {
  return gated_mul_backward_cpu<GateActivation::kSilu>("silu_mul_backward", grad_act, gate, up);
}

at::Tensor gelu_tanh_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return gated_mul_cpu<GateActivation::kGeluTanh>("gelu_tanh_mul", gate, up);
}

std::tuple<at::Tensor, at::Tensor> gelu_tanh_mul_backward_cpu(const at::Tensor& grad_act, const at::Tensor& gate,
                                                               const at::Tensor& up) {
  return gated_mul_backward_cpu<GateActivation::kGeluTanh>("gelu_tanh_mul_backward", grad_act, gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("silu_mul_backward", &silu_mul_backward_cpu);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul_cpu);
  m.impl("gelu_tanh_mul_backward", &gelu_tanh_mul_backward_cpu);
  m.impl("clamped_swiglu", &clamped_swiglu_cpu);
  m.impl("clamped_swiglu_backward", &clamped_swiglu_backward_cpu);
  m.impl("moe_weighted_swiglu", &moe_weighted_swiglu_cpu);
  m.impl("moe_weighted_swiglu_backward", &moe_weighted_swiglu_backward_cpu);
}

}  // namespace hasten
