// CPU reference of hasten::varlen_attention and its backward: one sequence at a time in float32
// with ATen ops (the readable definition the CUDA implementation is tested against).
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

#include "attention_checks.h"

namespace hasten {
namespace {

struct Sequence {
  at::Tensor q, k, v, probs;  // q (Hq, L, D); k, v repeated to (Hq, L, D); probs (Hq, L, L)
  at::Tensor cap_slope;       // softcap: d(capped)/d(scaled score) = 1 - tanh^2 (Hq, L, L); else undefined
};

// Scores of one sequence [start, end): softmax probabilities and their log-sum-exp (Hq, L).
// `given_lse` (the backward): the probabilities are exp(score - given_lse), with the forward's
// statistics as cuDNN and flash-attn take them, so a caller's statistics set the softmax's
// denominator (attention sinks: the forward's lse with each head's sink logit added in).
std::tuple<Sequence, at::Tensor> attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                                        int64_t end, double scale, bool causal, int64_t window, double softcap,
                                        const at::Tensor& given_lse = {}) {
  const int64_t groups = q.size(1) / k.size(1), length = end - start;
  auto heads_first = [&](const at::Tensor& x) { return x.slice(0, start, end).to(at::kFloat).permute({1, 0, 2}); };
  Sequence s{heads_first(q), heads_first(k).repeat_interleave(groups, 0), heads_first(v).repeat_interleave(groups, 0),
             {}, {}};
  auto scores = at::matmul(s.q, s.k.transpose(1, 2)) * scale;
  if (softcap > 0.0) {  // Gemma 2: c * tanh(s / c) on the scaled scores, before the mask
    auto t = at::tanh(scores / softcap);
    s.cap_slope = 1 - t * t;
    scores = t * softcap;
  }
  if (causal) scores.masked_fill_(at::ones({length, length}, at::kBool).triu(1), -INFINITY);
  // key j hidden from query i when j <= i - window: each query keeps itself and window - 1 before it
  if (window > 0) scores.masked_fill_(at::ones({length, length}, at::kBool).tril(-window), -INFINITY);
  auto lse = given_lse.defined() ? given_lse : at::logsumexp(scores, -1);
  s.probs = at::exp(scores - lse.unsqueeze(-1));
  return {s, lse};
}

// The contract the CUDA path cannot check without a host sync: boundaries within [0, T], non-decreasing,
// no sequence longer than max_seqlen.
void check_boundaries(const char* op, const at::Tensor& cu_seqlens, int64_t tokens, int64_t max_seqlen) {
  const auto cu = cu_seqlens.accessor<int32_t, 1>();
  TORCH_CHECK(cu[0] >= 0 && cu[cu_seqlens.numel() - 1] <= tokens, "hasten::", op, ": `cu_seqlens` must run from 0 to "
              "at most the token count ", num(tokens), "; got ", num(cu[0]), " .. ", num(cu[cu_seqlens.numel() - 1]));
  for (int64_t b = 0; b + 1 < cu_seqlens.numel(); ++b) {
    TORCH_CHECK(cu[b + 1] >= cu[b] && cu[b + 1] - cu[b] <= max_seqlen, "hasten::", op, ": sequence ", num(b),
                " spans cu_seqlens ", num(cu[b]), " .. ", num(cu[b + 1]),
                "; boundaries must not decrease and no sequence may exceed max_seqlen (", num(max_seqlen), ")");
  }
}

// (Hq, L, D) summed over each group of Hq / Hk query heads -> (L, Hk, D)
at::Tensor per_kv_head(const at::Tensor& x, int64_t kv_heads) {
  return x.reshape({kv_heads, x.size(0) / kv_heads, x.size(1), x.size(2)}).sum(1).permute({1, 0, 2});
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v, const at::Tensor& cu_seqlens,
                                                        int64_t max_seqlen, double scale, bool causal,
                                                        int64_t window, double softcap) {
  check_device(q, "varlen_attention", "q", c10::DeviceType::CPU);
  check_varlen_attention_args("varlen_attention", q, k, v, cu_seqlens, max_seqlen);
  check_attention_window("varlen_attention", causal, window);
  check_attention_softcap("varlen_attention", softcap);
  check_boundaries("varlen_attention", cu_seqlens, q.size(0), max_seqlen);
  auto out = at::zeros(q.sizes(), q.options());  // contiguous, as on CUDA (and the fake)
  auto lse = at::zeros({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  const auto cu = cu_seqlens.accessor<int32_t, 1>();
  for (int64_t b = 0; b + 1 < cu_seqlens.numel(); ++b) {
    if (cu[b + 1] <= cu[b]) continue;
    auto [s, seq_lse] = attend(q, k, v, cu[b], cu[b + 1], scale, causal, window, softcap);
    out.slice(0, cu[b], cu[b + 1]).copy_(at::matmul(s.probs, s.v).permute({1, 0, 2}));
    lse.slice(0, cu[b], cu[b + 1]).copy_(seq_lse.t());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens, int64_t max_seqlen, double scale, bool causal,
    int64_t window, double softcap) {
  check_device(q, "varlen_attention_backward", "q", c10::DeviceType::CPU);
  check_varlen_attention_backward_args(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen);
  check_attention_window("varlen_attention_backward", causal, window);
  check_attention_softcap("varlen_attention_backward", softcap);
  check_boundaries("varlen_attention_backward", cu_seqlens, q.size(0), max_seqlen);
  // contiguous, as on CUDA (and the fake)
  auto grad_q = at::zeros(q.sizes(), q.options()), grad_k = at::zeros(k.sizes(), k.options()),
       grad_v = at::zeros(v.sizes(), v.options());
  const auto cu = cu_seqlens.accessor<int32_t, 1>();
  for (int64_t b = 0; b + 1 < cu_seqlens.numel(); ++b) {
    const int64_t start = cu[b], end = cu[b + 1];
    if (end <= start) continue;
    auto [s, unused] = attend(q, k, v, start, end, scale, causal, window, softcap,
                              lse.slice(0, start, end).t().to(at::kFloat));  // (Hq, L)
    auto d_out = grad_out.slice(0, start, end).to(at::kFloat).permute({1, 0, 2});           // (Hq, L, D)
    auto o = out.slice(0, start, end).to(at::kFloat).permute({1, 0, 2});
    auto d_probs = at::matmul(d_out, s.v.transpose(1, 2));                                   // (Hq, L, L)
    auto d_scores = s.probs * (d_probs - (d_out * o).sum(-1, true));  // w.r.t. the (capped) scores
    if (s.cap_slope.defined()) d_scores = d_scores * s.cap_slope;
    grad_q.slice(0, start, end).copy_(at::matmul(d_scores, s.k).permute({1, 0, 2}) * scale);
    grad_k.slice(0, start, end).copy_(per_kv_head(at::matmul(d_scores.transpose(1, 2), s.q) * scale, k.size(1)));
    grad_v.slice(0, start, end).copy_(per_kv_head(at::matmul(s.probs.transpose(1, 2), d_out), k.size(1)));
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("varlen_attention", &varlen_attention_cpu);
  m.impl("varlen_attention_backward", &varlen_attention_backward_cpu);
}

}  // namespace hasten
