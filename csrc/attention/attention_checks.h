// Argument checks of hasten::varlen_attention and its backward (CPU and CUDA share them).
#pragma once

#include <cmath>

#include "hasten/checks.h"

namespace hasten {

inline void check_varlen_attention_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& cu_seqlens, int64_t max_seqlen) {
  check_dim(q, 3, op, "q", "(tokens, q_heads, head_dim)");
  check_dim(k, 3, op, "k", "(tokens, kv_heads, head_dim)");
  TORCH_CHECK(v.sizes() == k.sizes(), "hasten::", op, ": `v` must have k's shape ", shape(k.sizes()), ", got ",
              shape(v.sizes()));
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), "hasten::", op, ": `k` ", shape(k.sizes()),
              " must have q's token count and head_dim (q is ", shape(q.sizes()), ")");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "hasten::", op, ": q_heads (", num(q.size(1)),
              ") must be a multiple of kv_heads (", num(k.size(1)), ")");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "hasten::", op,
              ": q, k and v must share one dtype; got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  check_dim(cu_seqlens, 1, op, "cu_seqlens", "(num_seqs + 1,)");
  check_dtype(cu_seqlens, op, "cu_seqlens", {at::kInt});
  TORCH_CHECK(cu_seqlens.numel() >= 1, "hasten::", op, ": `cu_seqlens` needs at least one entry (0)");
  TORCH_CHECK(max_seqlen >= 0, "hasten::", op, ": `max_seqlen` must be >= 0, got ", num(max_seqlen));
  for (const auto* t : {&k, &v, &cu_seqlens}) check_same_device(q, *t, op, "q", "k, v or cu_seqlens");
}

// window W > 0: a query sees itself and the W - 1 tokens before it; only with causal attention.
inline void check_attention_window(const char* op, bool causal, int64_t window) {
  TORCH_CHECK(window >= 0, "hasten::", op, ": `window` must be >= 0 (0: no window), got ", num(window));
  TORCH_CHECK(window == 0 || causal, "hasten::", op, ": a sliding window (", num(window),
              ") needs causal attention; a two-sided window is not implemented");
}

// softcap c > 0: scores s -> c * tanh(s / c); 0: off.
inline void check_attention_softcap(const char* op, double softcap) {
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "hasten::", op,
              ": `softcap` must be 0 (off) or a positive finite number, got ", softcap);
}

inline void check_varlen_attention_backward_args(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                 const at::Tensor& cu_seqlens, int64_t max_seqlen) {
  const char* op = "varlen_attention_backward";
  check_varlen_attention_args(op, q, k, v, cu_seqlens, max_seqlen);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes(), "hasten::", op,
              ": `grad_out` and `out` must have q's shape ", shape(q.sizes()), ", got ", shape(grad_out.sizes()),
              " and ", shape(out.sizes()));
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1), "hasten::", op,
              ": `lse` must be (tokens, q_heads) = ", shape(q.sizes().slice(0, 2)), ", got ", shape(lse.sizes()));
  check_dtype(lse, op, "lse", {at::kFloat});
}

}  // namespace hasten
