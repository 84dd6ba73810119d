// hasten::lora_linear: a frozen base projection and its LoRA update in one op, so that autograd
// keeps what the backward needs and nothing else. Device-generic (CompositeExplicitAutograd): the
// GEMMs are ATen's (cuBLAS on the GPU, float32 on the CPU reference path); on CUDA the backward's
// gb and dB come from one kernel that reads g once for both (lora_backward.h, lora_linear_cuda.cpp).
//
// Shapes: x (T, in) after flattening its leading dims, weight W (out, in), lora_a A (r, in),
// lora_b B (out, r), s the LoRA scaling (alpha / r, or alpha / sqrt(r) for rsLoRA).
//   forward   xa = x_l A^T                  (T, r), x's dtype; x_l = dropout(x), or x itself
//             y  = s xa B^T (+ bias), s the thin GEMM's alpha; then y += x W^T: the base GEMM
//                                             accumulates onto it (beta = 1), no (T, out) temporary
//   backward  gb = s g B                     (T, r)
//             dB = s g^T xa                  (out, r)  in B's dtype
//             dA = gb^T x_l                  (r, in)   in A's dtype
//             dx = g W (+ gb A when x_l is x) (T, in);  else d x_l = gb A
// Adapters kept in float32 (PEFT's default under a bf16 base) are cast to x's dtype for the GEMMs
// once, in the forward, as one flat copy that the op returns for the backward (lora_backward.h,
// cast_adapters), and their gradients come out of the GEMM in float32 (cuBLAS accumulates in
// float32): the only copies of activations the op keeps are x_l (x itself without dropout, which
// the caller already holds) and xa; PEFT's own layer keeps a float32 copy of x per projection.
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>
#include <vector>

#include "lora_backward.h"

namespace hasten {
namespace {

using lora::check_group;
using lora::rank_offsets;
using lora::rows;

// y = scale * xa B^T (+ bias) (T, out) from xa (T, r) (a view of a wider xa in a group) and B (out, r):
// the scale as the GEMM's alpha, applied to its float32 accumulator (no scaled copy of xa, one
// launch fewer per projection). beta = 0 without a bias: y's old contents are not read (an empty
// tensor's NaNs cannot reach it).
void thin_update(at::Tensor& y, const at::Tensor& xa, const at::Tensor& b, const std::optional<at::Tensor>& bias,
                 double scale) {
  if (bias.has_value()) {
    at::addmm_out(y, *bias, xa, b.t(), 1.0, scale);
  } else {
    at::addmm_out(y, y, xa, b.t(), 0.0, scale);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_linear(const at::Tensor& x, const std::optional<at::Tensor>& x_lora,
                                                           const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                                           const at::Tensor& lora_a, const at::Tensor& lora_b,
                                                           double scale) {
  const char* op = "lora_linear";
  check_lora_linear_args(op, x, x_lora, weight, bias, lora_a, lora_b);
  const auto x2 = rows(x);
  const auto xl2 = x_lora.has_value() ? rows(*x_lora) : x2;
  // the adapters in x's dtype once, kept for the backward (empty when they have it already)
  auto adapters = lora::cast_adapters(lora_a, lora_b, x.scalar_type());
  const auto in = lora::adapters_in(op, adapters, lora_a, lora_b, x.scalar_type());
  const auto &a = in.a_all, &b = in.b[0];
  // The outputs are allocated in their final (..., out) and (..., r) shapes and the GEMMs write
  // into 2-D views of them: an output that were itself a view of a tensor made here would be, to
  // autograd, a view made inside a custom function, which a model may not change in place (OLMo
  // clamps its q/k/v projections in place, Gemma 3n adds into a projection's output).
  auto out_shape = x.sizes().vec();
  out_shape.back() = weight.size(0);
  auto xa_shape = x.sizes().vec();
  xa_shape.back() = lora_a.size(0);
  auto xa_out = at::empty(xa_shape, x.options());
  auto y_out = at::empty(out_shape, x.options());
  auto xa = xa_out.view({-1, lora_a.size(0)});  // (T, r)
  auto y = y_out.view({-1, weight.size(0)});    // (T, out)
  at::mm_out(xa, xl2, a.t());
  // the rank-r update first (a thin GEMM that only writes y), then the base GEMM accumulates onto it
  // (beta = 1: y is read in the big GEMM's epilogue, hidden under its compute)
  thin_update(y, xa, b, bias, scale);
  y.addmm_(x2, weight.t());
  return {y_out, xa_out, adapters};
}

// --- projections that share their input (q/k/v, gate/up) ------------------------------------------
// Against one lora_linear per member, the group reads x once for the thin GEMM of the forward and
// once for d lora_a (all members' A stacked: [A_0; A_1; ...] (R, in), R = sum r_i), and d x is one
// tensor that every member's base GEMM accumulates onto (beta = 1) instead of n results autograd
// adds afterwards (two passes over a (T, in) tensor per add).

std::optional<at::Tensor> bias_of(at::TensorList biases, size_t i) {
  return biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[i]);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> lora_linear_group(
    const at::Tensor& x, at::TensorList weights, at::TensorList biases,
    at::TensorList lora_a, at::TensorList lora_b, at::ArrayRef<double> scales) {
  const char* op = "lora_linear_group";
  check_group(op, weights, lora_a, lora_b, scales, biases.size());
  const size_t n = weights.size();
  for (size_t i = 0; i < n; ++i) {
    check_lora_linear_args(op, x, std::nullopt, weights[i], bias_of(biases, i), lora_a[i], lora_b[i]);
  }
  const auto offsets = rank_offsets(lora_a);
  const auto x2 = rows(x);
  auto adapters = lora::cast_adapters(lora_a, lora_b, x.scalar_type());  // kept for the backward
  const auto in = lora::adapters_in(op, adapters, lora_a, lora_b, x.scalar_type());
  const auto& a_all = in.a_all;  // (R, in)
  auto xa_shape = x.sizes().vec();
  xa_shape.back() = offsets.back();
  auto xa_out = at::empty(xa_shape, x.options());
  auto xa = xa_out.view({-1, offsets.back()});  // (T, R)
  at::mm_out(xa, x2, a_all.t());
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < n; ++i) {
    auto out_shape = x.sizes().vec();
    out_shape.back() = weights[i].size(0);
    auto y_out = at::empty(out_shape, x.options());  // allocated whole, not a view (see lora_linear)
    auto y = y_out.view({-1, weights[i].size(0)});
    thin_update(y, xa.narrow(1, offsets[i], offsets[i + 1] - offsets[i]), in.b[i], bias_of(biases, i), scales[i]);
    y.addmm_(x2, weights[i].t());  // the base GEMM accumulates onto the rank-r update, as in lora_linear
    ys.push_back(y_out);
  }
  return {ys, xa_out, adapters};
}

// The backward ops with ATen's GEMMs for the thin products (csrc/lora/lora_linear_cuda.cpp
// registers the CUDA ones with the kernel that reads grad_y once).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward(
    const at::Tensor& grad_y, const at::Tensor& x_lora, const at::Tensor& weight, const at::Tensor& lora_a,
    const at::Tensor& lora_b, const at::Tensor& xa, double scale, bool shared_input,
    const std::optional<at::Tensor>& adapters) {
  return lora::linear_backward(&lora::thin_grads_gemms, grad_y, x_lora, weight, lora_a, lora_b, xa, scale,
                               shared_input, adapters);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_linear_group_backward(
    at::TensorList grad_ys, const at::Tensor& x, at::TensorList weights, at::TensorList lora_a,
    at::TensorList lora_b, const at::Tensor& xa, at::ArrayRef<double> scales, bool grad_input,
    const std::optional<at::Tensor>& adapters) {
  return lora::group_backward(&lora::thin_grads_gemms, grad_ys, x, weights, lora_a, lora_b, xa, scales, grad_input,
                              adapters);
}

// --- a gated MLP's gate/up group and its activation: act = f(gate) * up ---------------------------
// The forward is the group's and then the activation's op (the same kernels as separately); the
// outputs gate, up and xa are what the backward reads (autograd keeps them, as it keeps gate and
// up for the activation and xa for the group when they run as two ops). One op for both lets the
// backward on CUDA form the activation's gradient and both members' thin products in one pass
// (lora_linear_cuda.cpp); here it is the activation's backward op, then the group's.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_gated_group(
    const at::Tensor& x, at::TensorList weights, at::TensorList biases, at::TensorList lora_a, at::TensorList lora_b,
    at::ArrayRef<double> scales, c10::string_view activation) {
  const char* op = "lora_gated_group";
  lora::check_gated_group(op, weights, lora_a, lora_b, scales, biases.size());
  const lora::GatedForward& forward = lora::gated_forward_op(op, activation);
  // the group's copy of the adapters is dropped: this op's backward casts them itself
  std::vector<at::Tensor> ys;
  at::Tensor xa;
  std::tie(ys, xa, std::ignore) = lora_linear_group(x, weights, biases, lora_a, lora_b, scales);
  auto act = forward.call(ys[0], ys[1]);
  return {act, ys[0], ys[1], xa};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_gated_group_backward(
    const at::Tensor& grad_act, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& x,
    at::TensorList weights, at::TensorList lora_a, at::TensorList lora_b, const at::Tensor& xa,
    at::ArrayRef<double> scales, c10::string_view activation, bool grad_input) {
  return lora::gated_group_backward(nullptr, &lora::thin_grads_gemms, grad_act, gate, up, x, weights, lora_a, lora_b,
                                    xa, scales, activation, grad_input);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CompositeExplicitAutograd, m) {
  m.impl("lora_linear", &lora_linear);
  m.impl("lora_linear_backward", &lora_linear_backward);
  m.impl("lora_linear_group", &lora_linear_group);
  m.impl("lora_linear_group_backward", &lora_linear_group_backward);
  m.impl("lora_gated_group", &lora_gated_group);
  m.impl("lora_gated_group_backward", &lora_gated_group_backward);
}

}  // namespace hasten
