// hasten::lora_linear: a frozen base projection and its LoRA update in one op, so that autograd
// keeps what the backward needs and nothing else. Device-generic (CompositeExplicitAutograd): the
// GEMMs are ATen's (cuBLAS on the GPU, float32 on the CPU reference path).
//
// Shapes: x (T, in) after flattening its leading dims, weight W (out, in), lora_a A (r, in),
// lora_b B (out, r), s the LoRA scaling (alpha / r, or alpha / sqrt(r) for rsLoRA).
//   forward   xa = x_l A^T                  (T, r), x's dtype; x_l = dropout(x), or x itself
//             y  = s xa B^T (+ bias), then y += x W^T: the base GEMM accumulates onto the thin
//                                             GEMM's output (beta = 1), no (T, out) temporary
//   backward  gb = s g B                     (T, r)
//             dB = s g^T xa                  (out, r)  in B's dtype
//             dA = gb^T x_l                  (r, in)   in A's dtype
//             dx = g W (+ gb A when x_l is x) (T, in);  else d x_l = gb A
// Adapters kept in float32 (PEFT's default under a bf16 base) are cast to x's dtype for the GEMMs,
// and their gradients come out of the GEMM in float32 (cuBLAS accumulates in float32): the only
// copies of activations the op keeps are x_l (x itself without dropout, which the caller already
// holds) and xa; PEFT's own layer keeps a float32 copy of x per projection.
#include <torch/library.h>
#include <torch/types.h>
#include <torch/version.h>

#include <tuple>
#include <vector>

#include "lora_checks.h"

namespace hasten {
namespace {

at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// a @ b with the result in `dtype`: on CUDA from the GEMM's float32 accumulator directly
// (aten::mm.dtype, torch >= 2.8), elsewhere through a cast of the product.
at::Tensor mm_as(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (a.is_cuda() && dtype == at::kFloat && (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    return at::mm(a, b, dtype);
  }
#endif
  return at::mm(a, b).to(dtype);
}

std::tuple<at::Tensor, at::Tensor> lora_linear(const at::Tensor& x, const std::optional<at::Tensor>& x_lora,
                                               const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                               const at::Tensor& lora_a, const at::Tensor& lora_b, double scale) {
  const char* op = "lora_linear";
  check_lora_linear_args(op, x, x_lora, weight, bias, lora_a, lora_b);
  const auto x2 = rows(x);
  const auto xl2 = x_lora.has_value() ? rows(*x_lora) : x2;
  const auto a = lora_a.to(x.scalar_type()), b = lora_b.to(x.scalar_type());
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
  const auto xa_scaled = xa * scale;
  if (bias.has_value()) {
    at::addmm_out(y, *bias, xa_scaled, b.t());
  } else {
    at::mm_out(y, xa_scaled, b.t());
  }
  y.addmm_(x2, weight.t());
  return {y_out, xa_out};
}

// grad_x: d/dx through the base projection (and through the LoRA path when x_lora is x);
// grad_x_lora: d/dx_lora when the op was given a separate x_lora (else an empty tensor).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward(
    const at::Tensor& grad_y, const at::Tensor& x_lora, const at::Tensor& weight, const at::Tensor& lora_a,
    const at::Tensor& lora_b, const at::Tensor& xa, double scale, bool shared_input) {
  const char* op = "lora_linear_backward";
  check_lora_linear_args(op, x_lora, std::nullopt, weight, std::nullopt, lora_a, lora_b);
  TORCH_CHECK(grad_y.size(-1) == weight.size(0) && grad_y.numel() / weight.size(0) == rows_of(x_lora), "hasten::",
              op, ": `grad_y` ", shape(grad_y.sizes()), " must be (..., ", num(weight.size(0)), ") over x's rows");
  TORCH_CHECK(xa.size(-1) == lora_a.size(0) && rows_of(xa) == rows_of(x_lora), "hasten::", op, ": `xa` ",
              shape(xa.sizes()), " must be (..., ", num(lora_a.size(0)), ") over x's rows");
  const auto g = rows(grad_y.to(x_lora.scalar_type())), xl2 = rows(x_lora), xa2 = rows(xa);
  const auto a = lora_a.to(x_lora.scalar_type()), b = lora_b.to(x_lora.scalar_type());
  auto gb = at::mm(g, b).mul_(scale);                                  // (T, r)
  auto grad_b = mm_as(g.t(), xa2, lora_b.scalar_type()).mul_(scale);   // (out, r)
  auto grad_a = mm_as(gb.t(), xl2, lora_a.scalar_type());              // (r, in)
  at::Tensor grad_x, grad_x_lora = at::empty({0}, x_lora.options());
  if (shared_input) {  // as in the forward: the thin GEMM writes, the base GEMM accumulates onto it
    grad_x = at::mm(gb, a).addmm_(g, weight);                          // (T, in)
  } else {
    grad_x = at::mm(g, weight);
    grad_x_lora = at::mm(gb, a).view(x_lora.sizes());
  }
  return {grad_x.view(x_lora.sizes()), grad_x_lora, grad_a, grad_b};
}

// --- projections that share their input (q/k/v, gate/up) ------------------------------------------
// Against one lora_linear per member, the group reads x once for the thin GEMM of the forward and
// once for d lora_a (all members' A stacked: [A_0; A_1; ...] (R, in), R = sum r_i), and d x is one
// tensor that every member's base GEMM accumulates onto (beta = 1) instead of n results autograd
// adds afterwards (two passes over a (T, in) tensor per add).

// Where each member's rank starts in the stacked R: {0, r_0, r_0 + r_1, ..., R}.
std::vector<int64_t> rank_offsets(at::TensorList lora_a) {
  std::vector<int64_t> offsets{0};
  for (const auto& a : lora_a) offsets.push_back(offsets.back() + a.size(0));
  return offsets;
}

void check_group(const char* op, at::TensorList weights, at::TensorList lora_a,
                 at::TensorList lora_b, at::ArrayRef<double> scales, size_t biases) {
  const size_t n = weights.size();
  TORCH_CHECK(n >= 1, "hasten::", op, ": the group needs at least one projection, got none");
  TORCH_CHECK(lora_a.size() == n && lora_b.size() == n && scales.size() == n && (biases == 0 || biases == n),
              "hasten::", op, ": weights, lora_a, lora_b and scales must have one entry per projection, and biases "
              "none or one per projection, got ", n, ", ", lora_a.size(), ", ", lora_b.size(), ", ", scales.size(),
              " and ", biases);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(lora_a[i].scalar_type() == lora_a[0].scalar_type() &&
                    lora_b[i].scalar_type() == lora_b[0].scalar_type(),
                "hasten::", op, ": every projection's lora_a must share one dtype, and every lora_b one dtype");
  }
}

std::optional<at::Tensor> bias_of(at::TensorList biases, size_t i) {
  return biases.empty() ? std::nullopt : std::optional<at::Tensor>(biases[i]);
}

std::tuple<std::vector<at::Tensor>, at::Tensor> lora_linear_group(
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
  std::vector<at::Tensor> stacked;
  for (const auto& a : lora_a) stacked.push_back(a.to(x.scalar_type()));
  const auto a_all = at::cat(stacked, 0);  // (R, in)
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
    const auto xa_scaled = xa.narrow(1, offsets[i], offsets[i + 1] - offsets[i]) * scales[i];  // (T, r_i)
    const auto b = lora_b[i].to(x.scalar_type());
    const auto bias = bias_of(biases, i);
    if (bias.has_value()) {
      at::addmm_out(y, *bias, xa_scaled, b.t());
    } else {
      at::mm_out(y, xa_scaled, b.t());
    }
    y.addmm_(x2, weights[i].t());  // the base GEMM accumulates onto the rank-r update, as in lora_linear
    ys.push_back(y_out);
  }
  return {ys, xa_out};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> lora_linear_group_backward(
    at::TensorList grad_ys, const at::Tensor& x, at::TensorList weights, at::TensorList lora_a,
    at::TensorList lora_b, const at::Tensor& xa, at::ArrayRef<double> scales) {
  const char* op = "lora_linear_group_backward";
  check_group(op, weights, lora_a, lora_b, scales, 0);
  const size_t n = weights.size();
  TORCH_CHECK(grad_ys.size() == n, "hasten::", op, ": one grad_y per projection, got ", grad_ys.size(), " for ", n);
  const auto offsets = rank_offsets(lora_a);
  TORCH_CHECK(xa.size(-1) == offsets.back() && rows_of(xa) == rows_of(x), "hasten::", op, ": `xa` ",
              shape(xa.sizes()), " must be (..., ", num(offsets.back()), ") over x's rows");
  const auto dtype = x.scalar_type();
  const auto x2 = rows(x), xa2 = rows(xa);
  std::vector<at::Tensor> gs, stacked, grad_b;
  for (size_t i = 0; i < n; ++i) {
    check_lora_linear_args(op, x, std::nullopt, weights[i], std::nullopt, lora_a[i], lora_b[i]);
    TORCH_CHECK(grad_ys[i].size(-1) == weights[i].size(0) && rows_of(grad_ys[i]) == rows_of(x), "hasten::", op,
                ": `grad_ys[", i, "]` ", shape(grad_ys[i].sizes()), " must be (..., ", num(weights[i].size(0)),
                ") over x's rows");
    gs.push_back(rows(grad_ys[i].to(dtype)));
    stacked.push_back(lora_a[i].to(dtype));
  }
  // gb = [s_0 g_0 B_0 | s_1 g_1 B_1 | ...] (T, R); d B_i = s_i g_i^T xa_i (out_i, r_i)
  auto gb = at::empty({x2.size(0), offsets.back()}, x.options());
  for (size_t i = 0; i < n; ++i) {
    const auto b = lora_b[i].to(dtype);
    gb.narrow(1, offsets[i], offsets[i + 1] - offsets[i]).copy_(at::mm(gs[i], b).mul_(scales[i]));
    grad_b.push_back(mm_as(gs[i].t(), xa2.narrow(1, offsets[i], offsets[i + 1] - offsets[i]),
                           lora_b[i].scalar_type()).mul_(scales[i]));
  }
  const auto grad_a_all = mm_as(gb.t(), x2, lora_a[0].scalar_type());  // (R, in): x read once
  std::vector<at::Tensor> grad_a;
  for (size_t i = 0; i < n; ++i) grad_a.push_back(grad_a_all.narrow(0, offsets[i], offsets[i + 1] - offsets[i]).clone());
  auto grad_x = at::mm(gb, at::cat(stacked, 0));  // (T, in): the LoRA paths, then each base GEMM onto it
  for (size_t i = 0; i < n; ++i) grad_x.addmm_(gs[i], weights[i]);
  return {grad_x.view(x.sizes()), grad_a, grad_b};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CompositeExplicitAutograd, m) {
  m.impl("lora_linear", &lora_linear);
  m.impl("lora_linear_backward", &lora_linear_backward);
  m.impl("lora_linear_group", &lora_linear_group);
  m.impl("lora_linear_group_backward", &lora_linear_group_backward);
}

}  // namespace hasten
