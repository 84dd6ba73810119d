// The backward of hasten::lora_linear and hasten::lora_linear_group, shared by every device. The
// two thin products that read the output gradient g,
//   gb = s g B (T, r)   and   d B = s g^T xa (out, r),
// come from the device's ThinGrads: ATen's two GEMMs (CPU, and CUDA where its kernel does not take
// the shapes) or the CUDA kernel that reads g once for both (csrc/kernels/lora_grads.cuh). Also
// here: what the forward ops share with their backward (rows, mm_as, the adapters' one copy in x's
// dtype and its views, the group's rank offsets and checks), and the backward of a gated MLP over a
// gate/up group (lora_gated_group).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>
#include <torch/version.h>

#include <string>
#include <tuple>
#include <vector>

#include "lora_checks.h"

namespace hasten {
namespace lora {

inline at::Tensor rows(const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); }

// a @ b with the result in `dtype`: on CUDA from the GEMM's float32 accumulator directly
// (aten::mm.dtype, torch >= 2.8), elsewhere through a cast of the product.
inline at::Tensor mm_as(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
  if (a.is_cuda() && dtype == at::kFloat && (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    return at::mm(a, b, dtype);
  }
#endif
  return at::mm(a, b).to(dtype);
}

// Writes gb_out (T, r), a view, with s g B and returns d B = s g^T xa (out, r) in grad_b_dtype.
// g (T, out) and xa (T, r) in x's dtype, b = lora_b (out, r) cast to it.
using ThinGrads = at::Tensor (*)(const at::Tensor& g, const at::Tensor& b, const at::Tensor& xa, double scale,
                                 at::ScalarType grad_b_dtype, at::Tensor& gb_out);

// ATen's GEMMs: g read once for each product.
inline at::Tensor thin_grads_gemms(const at::Tensor& g, const at::Tensor& b, const at::Tensor& xa, double scale,
                                   at::ScalarType grad_b_dtype, at::Tensor& gb_out) {
  at::mm_out(gb_out, g, b).mul_(scale);
  return mm_as(g.t(), xa, grad_b_dtype).mul_(scale);
}

// --- adapters kept in another dtype than x's (PEFT's float32 under a bf16 base) --------------------
// The forward casts them for its GEMMs once, as one flat copy in x's dtype,
//   [A_0 | A_1 | ... | A_{n-1} | B_0 | B_1 | ... | B_{n-1}]   (each flattened, row-major),
// in two launches (a cat, a cast) instead of a cast per tensor and a cat of the A's, and returns it
// for autograd to keep; the backward reads views of it instead of casting every adapter again
// (about 30 small launches fewer per decoder layer of W4's Llama-8B shape, each with its gap).
// Empty when every adapter already has x's dtype: the adapters themselves are then read.
inline at::Tensor cast_adapters(at::TensorList lora_a, at::TensorList lora_b, at::ScalarType dtype) {
  bool all_in_dtype = true;
  for (const auto& t : lora_a) all_in_dtype = all_in_dtype && t.scalar_type() == dtype;
  for (const auto& t : lora_b) all_in_dtype = all_in_dtype && t.scalar_type() == dtype;
  if (all_in_dtype) return at::empty({0}, lora_a[0].options().dtype(dtype));
  std::vector<at::Tensor> flat;
  for (const auto& t : lora_a) flat.push_back(t.reshape({-1}));
  for (const auto& t : lora_b) flat.push_back(t.reshape({-1}));
  return at::cat(flat).to(dtype);
}

// The adapters as the GEMMs read them, in `dtype`: all A's stacked (R, in) and each B_i (out_i, r_i).
struct AdaptersIn {
  at::Tensor a_all;
  std::vector<at::Tensor> b;
};

// Views of `cast` (cast_adapters' copy) when it has elements; else the adapters cast one by one
// (a no-op for those already in `dtype`: the forward's empty copy, or a backward called without
// it), the A's stacked by a cat when there are several.
inline AdaptersIn adapters_in(const char* op, const std::optional<at::Tensor>& cast, at::TensorList lora_a,
                              at::TensorList lora_b, at::ScalarType dtype) {
  AdaptersIn in;
  if (cast.has_value() && cast->defined() && cast->numel() > 0) {
    int64_t total = 0;
    for (const auto& t : lora_a) total += t.numel();
    for (const auto& t : lora_b) total += t.numel();
    TORCH_CHECK(cast->dim() == 1 && cast->numel() == total && cast->scalar_type() == dtype &&
                    cast->device() == lora_a[0].device() && cast->is_contiguous(),
                "hasten::", op, ": `adapters` must be the forward's flat copy of lora_a and lora_b (", total,
                " contiguous elements in x's dtype ", dtype, " on ", lora_a[0].device(), "), got ",
                shape(cast->sizes()), " ", cast->scalar_type());
    const int64_t in_features = lora_a[0].size(1);
    int64_t ranks = 0;
    for (const auto& t : lora_a) ranks += t.size(0);
    in.a_all = cast->narrow(0, 0, ranks * in_features).view({ranks, in_features});
    int64_t offset = ranks * in_features;
    for (const auto& t : lora_b) {
      in.b.push_back(cast->narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    return in;
  }
  if (lora_a.size() == 1) {
    in.a_all = lora_a[0].to(dtype);
  } else {
    std::vector<at::Tensor> stacked;
    for (const auto& a : lora_a) stacked.push_back(a.to(dtype));
    in.a_all = at::cat(stacked, 0);
  }
  for (const auto& b : lora_b) in.b.push_back(b.to(dtype));
  return in;
}

// grad_x: d/dx through the base projection (and through the LoRA path when x_lora is x);
// grad_x_lora: d/dx_lora when the op was given a separate x_lora (else an empty tensor).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_backward(
    ThinGrads thin_grads, const at::Tensor& grad_y, const at::Tensor& x_lora, const at::Tensor& weight,
    const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& xa, double scale, bool shared_input,
    const std::optional<at::Tensor>& adapters) {
  const char* op = "lora_linear_backward";
  check_lora_linear_args(op, x_lora, std::nullopt, weight, std::nullopt, lora_a, lora_b);
  TORCH_CHECK(grad_y.size(-1) == weight.size(0) && grad_y.numel() / weight.size(0) == rows_of(x_lora), "hasten::",
              op, ": `grad_y` ", shape(grad_y.sizes()), " must be (..., ", num(weight.size(0)), ") over x's rows");
  TORCH_CHECK(xa.size(-1) == lora_a.size(0) && rows_of(xa) == rows_of(x_lora), "hasten::", op, ": `xa` ",
              shape(xa.sizes()), " must be (..., ", num(lora_a.size(0)), ") over x's rows");
  const auto g = rows(grad_y.to(x_lora.scalar_type())), xl2 = rows(x_lora), xa2 = rows(xa);
  const auto in = adapters_in(op, adapters, lora_a, lora_b, x_lora.scalar_type());
  const auto &a = in.a_all, &b = in.b[0];
  auto gb = at::empty({g.size(0), lora_a.size(0)}, g.options());             // (T, r)
  auto grad_b = thin_grads(g, b, xa2, scale, lora_b.scalar_type(), gb);    // (out, r)
  auto grad_a = mm_as(gb.t(), xl2, lora_a.scalar_type());                  // (r, in)
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

// Where each member's rank starts in the stacked R: {0, r_0, r_0 + r_1, ..., R}.
inline std::vector<int64_t> rank_offsets(at::TensorList lora_a) {
  std::vector<int64_t> offsets{0};
  for (const auto& a : lora_a) offsets.push_back(offsets.back() + a.size(0));
  return offsets;
}

inline void check_group(const char* op, at::TensorList weights, at::TensorList lora_a, at::TensorList lora_b,
                        at::ArrayRef<double> scales, size_t biases) {
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

// The group's backward after its thin products: gs the members' output gradients (T, out_i) in x's
// dtype, gb = [s_0 g_0 B_0 | s_1 g_1 B_1 | ...] (T, R), grad_b the d B_i. d A for all members from one
// read of x, and d x as the LoRA paths' GEMM that every base GEMM accumulates onto (grad_input
// false: an empty d x, none of those GEMMs run). a_all: the A's stacked (R, in) in x's dtype.
// d A comes back stacked (R, in), as its one GEMM writes it: the caller's split into the members'
// (r_i, in) rows is views, not a copy per member (5 launches a decoder layer of W4).
inline std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> group_backward_after_thin(
    const std::vector<at::Tensor>& gs, const at::Tensor& gb, std::vector<at::Tensor> grad_b, const at::Tensor& x,
    at::TensorList weights, at::TensorList lora_a, const at::Tensor& a_all, bool grad_input) {
  const size_t n = weights.size();
  const auto grad_a = mm_as(gb.t(), rows(x), lora_a[0].scalar_type());  // (R, in): x read once
  if (!grad_input) return {at::empty({0}, x.options()), grad_a, std::move(grad_b)};
  auto grad_x = at::mm(gb, a_all);  // (T, in): the LoRA paths, then each base GEMM onto it
  for (size_t i = 0; i < n; ++i) grad_x.addmm_(gs[i], weights[i]);
  return {grad_x.view(x.sizes()), grad_a, std::move(grad_b)};
}

inline std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> group_backward(
    ThinGrads thin_grads, at::TensorList grad_ys, const at::Tensor& x, at::TensorList weights,
    at::TensorList lora_a, at::TensorList lora_b, const at::Tensor& xa, at::ArrayRef<double> scales,
    bool grad_input, const std::optional<at::Tensor>& adapters) {
  const char* op = "lora_linear_group_backward";
  check_group(op, weights, lora_a, lora_b, scales, 0);
  const size_t n = weights.size();
  TORCH_CHECK(grad_ys.size() == n, "hasten::", op, ": one grad_y per projection, got ", grad_ys.size(), " for ", n);
  const auto offsets = rank_offsets(lora_a);
  TORCH_CHECK(xa.size(-1) == offsets.back() && rows_of(xa) == rows_of(x), "hasten::", op, ": `xa` ",
              shape(xa.sizes()), " must be (..., ", num(offsets.back()), ") over x's rows");
  const auto dtype = x.scalar_type();
  const auto xa2 = rows(xa);
  std::vector<at::Tensor> gs, grad_b;
  for (size_t i = 0; i < n; ++i) {
    check_lora_linear_args(op, x, std::nullopt, weights[i], std::nullopt, lora_a[i], lora_b[i]);
    TORCH_CHECK(grad_ys[i].size(-1) == weights[i].size(0) && rows_of(grad_ys[i]) == rows_of(x), "hasten::", op,
                ": `grad_ys[", i, "]` ", shape(grad_ys[i].sizes()), " must be (..., ", num(weights[i].size(0)),
                ") over x's rows");
    gs.push_back(rows(grad_ys[i].to(dtype)));
  }
  const auto in = adapters_in(op, adapters, lora_a, lora_b, dtype);
  // gb = [s_0 g_0 B_0 | s_1 g_1 B_1 | ...] (T, R); d B_i = s_i g_i^T xa_i (out_i, r_i)
  auto gb = at::empty({rows_of(x), offsets.back()}, x.options());
  for (size_t i = 0; i < n; ++i) {
    const int64_t rank = offsets[i + 1] - offsets[i];
    auto gb_i = gb.narrow(1, offsets[i], rank);
    grad_b.push_back(thin_grads(gs[i], in.b[i], xa2.narrow(1, offsets[i], rank), scales[i],
                                lora_b[i].scalar_type(), gb_i));
  }
  return group_backward_after_thin(gs, gb, std::move(grad_b), x, weights, lora_a, in.a_all, grad_input);
}

// --- a gated MLP over a gate/up group: act = f(gate) * up (hasten::lora_gated_group) ----------------

// The gated-MLP ops of an activation name, "silu" (SwiGLU) or "gelu_tanh" (GeGLU), through the
// dispatcher (their CPU or CUDA kernel); each handle looked up once.
using GatedForward = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>;
using GatedBackward = c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                                 const at::Tensor&)>;

inline bool is_silu(const char* op, c10::string_view activation) {
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "hasten::", op,
              ": `activation` must be \"silu\" or \"gelu_tanh\", got \"", std::string(activation), "\"");
  return activation == "silu";
}

inline const GatedForward& gated_forward_op(const char* op, c10::string_view activation) {
  static const GatedForward silu = c10::Dispatcher::singleton().findSchemaOrThrow("hasten::silu_mul", "")
                                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  static const GatedForward gelu_tanh = c10::Dispatcher::singleton().findSchemaOrThrow("hasten::gelu_tanh_mul", "")
                                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return is_silu(op, activation) ? silu : gelu_tanh;
}

inline const GatedBackward& gated_backward_op(const char* op, c10::string_view activation) {
  using Signature = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
  static const GatedBackward silu =
      c10::Dispatcher::singleton().findSchemaOrThrow("hasten::silu_mul_backward", "").typed<Signature>();
  static const GatedBackward gelu_tanh =
      c10::Dispatcher::singleton().findSchemaOrThrow("hasten::gelu_tanh_mul_backward", "").typed<Signature>();
  return is_silu(op, activation) ? silu : gelu_tanh;
}

inline void check_gated_group(const char* op, at::TensorList weights, at::TensorList lora_a, at::TensorList lora_b,
                              at::ArrayRef<double> scales, size_t biases) {
  check_group(op, weights, lora_a, lora_b, scales, biases);
  TORCH_CHECK(weights.size() == 2 && weights[0].size(0) == weights[1].size(0), "hasten::", op,
              ": the group must be [gate, up], two projections of one output size, got ", weights.size(),
              " projections", weights.size() == 2 ? " of output sizes " + std::to_string(weights[0].size(0)) +
              " and " + std::to_string(weights[1].size(0)) : std::string());
}

// The one-pass path of a device (the activation's backward with both members' thin products): fills
// d_gate and d_up (T, N), gb (T, R) and grad_b, or returns false when it does not take these inputs.
using GatedGrads = bool (*)(const at::Tensor& grad_act, const at::Tensor& gate, const at::Tensor& up,
                            c10::string_view activation, const at::Tensor& xa, at::TensorList lora_b,
                            at::ArrayRef<double> scales, at::ScalarType grad_b_dtype, std::vector<at::Tensor>& gs,
                            at::Tensor& gb, std::vector<at::Tensor>& grad_b);

// d act -> (d x, d lora_a, d lora_b) of act = f(gate) * up over the gate/up group: through the
// device's one pass where it takes the inputs (`gated_grads`, may be null), else the activation's
// backward op and then the group's backward.
inline std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> gated_group_backward(
    GatedGrads gated_grads, ThinGrads thin_grads, const at::Tensor& grad_act, const at::Tensor& gate,
    const at::Tensor& up, const at::Tensor& x, at::TensorList weights, at::TensorList lora_a, at::TensorList lora_b,
    const at::Tensor& xa, at::ArrayRef<double> scales, c10::string_view activation, bool grad_input) {
  const char* op = "lora_gated_group_backward";
  check_gated_group(op, weights, lora_a, lora_b, scales, 0);
  const GatedBackward& activation_backward = gated_backward_op(op, activation);
  const int64_t inner = weights[0].size(0);
  for (const auto* t : {&grad_act, &gate, &up}) {
    TORCH_CHECK(t->size(-1) == inner && rows_of(*t) == rows_of(x) && t->scalar_type() == x.scalar_type(),
                "hasten::", op, ": `grad_act`, `gate` and `up` must be (..., ", num(inner), ") over x's rows in x's "
                "dtype, got ", shape(t->sizes()), " ", t->scalar_type());
  }
  const auto offsets = rank_offsets(lora_a);
  TORCH_CHECK(xa.size(-1) == offsets.back() && rows_of(xa) == rows_of(x), "hasten::", op, ": `xa` ",
              shape(xa.sizes()), " must be (..., ", num(offsets.back()), ") over x's rows");
  if (gated_grads != nullptr) {  // (group_backward checks the members on the other path)
    for (size_t i = 0; i < 2; ++i) check_lora_linear_args(op, x, std::nullopt, weights[i], std::nullopt, lora_a[i], lora_b[i]);
    std::vector<at::Tensor> gs, grad_b;
    auto gb = at::empty({rows_of(x), offsets.back()}, x.options());
    const auto in = adapters_in(op, std::nullopt, lora_a, lora_b, x.scalar_type());
    if (gated_grads(grad_act, gate, up, activation, rows(xa), in.b, scales, lora_b[0].scalar_type(), gs, gb,
                    grad_b)) {
      return group_backward_after_thin(gs, gb, std::move(grad_b), x, weights, lora_a, in.a_all, grad_input);
    }
  }
  const auto [grad_gate, grad_up] = activation_backward.call(grad_act, gate, up);
  return group_backward(thin_grads, {grad_gate, grad_up}, x, weights, lora_a, lora_b, xa, scales, grad_input,
                        std::nullopt);
}

}  // namespace lora
}  // namespace hasten
