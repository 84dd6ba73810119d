// hasten::linear_cross_entropy: LM head + cross-entropy in chunks of tokens, so the full
// (tokens, vocab) logits never exist. Device-generic (CompositeExplicitAutograd): the matmuls are
// ATen's (cuBLAS on GPU), the per-row loss and in-place gradient are hasten::cross_entropy_rows_.
//
// Per chunk of C tokens (C chosen so that a chunk's logits take about 1 GiB):
//   logits (C, V)   = hidden_c @ weight^T (+ bias)             hidden's dtype
//   loss_rows (C,)  , logits <- d loss_sum / d logits * scale  float accumulation, in place
//   grad_hidden_c   = logits @ weight                           (C, H)
//   grad_weight    += logits^T @ hidden_c                       float32 accumulator (V, H), unless
//                                                               weight_grad is false (a frozen head)
// The gradients are computed in the forward and scaled by the upstream gradient in backward
// (ops/loss.py): one pass over the vocabulary instead of keeping logits for backward.
// loss = sum(loss_rows) / denominator, where denominator is the caller's count of target
// tokens (transformers' num_items_in_batch semantics across accumulation steps and ranks).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <tuple>

#include "loss_checks.h"

namespace hasten {
namespace {

constexpr int64_t kChunkLogitBytes = int64_t{1} << 30;

at::Tensor call_cross_entropy_rows(at::Tensor& logits, const at::Tensor& targets,
                                   const std::optional<at::Tensor>& grad_scale, int64_t ignore_index,
                                   double label_smoothing, double softcap) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hasten::cross_entropy_rows_", "")
                       .typed<at::Tensor(at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                         double, double)>();
  return op.call(logits, targets, grad_scale, ignore_index, label_smoothing, softcap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& hidden_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias,
    const at::Tensor& targets, const at::Tensor& denominator, int64_t ignore_index, double label_smoothing,
    double softcap, int64_t chunk_tokens, bool compute_grad, bool weight_grad) {
  check_linear_cross_entropy_args(hidden_in, weight_in, bias, targets, denominator);
  const auto hidden = hidden_in.contiguous();
  const auto weight = weight_in.contiguous();
  const int64_t tokens = hidden.size(0), vocab = weight.size(0);
  const int64_t row_bytes = std::max<int64_t>(1, vocab * static_cast<int64_t>(hidden.element_size()));
  const int64_t chunk = chunk_tokens > 0 ? chunk_tokens : std::max<int64_t>(1, kChunkLogitBytes / row_bytes);
  const auto float_opts = hidden.options().dtype(at::kFloat);

  auto loss_rows = at::empty({tokens}, float_opts);
  at::Tensor grad_hidden, grad_weight_acc, grad_bias_acc;
  std::optional<at::Tensor> scale;
  const bool want_weight = compute_grad && weight_grad;
  if (compute_grad) {
    grad_hidden = at::empty_like(hidden);
    if (want_weight) grad_weight_acc = at::zeros({vocab, hidden.size(1)}, float_opts);
    if (bias) grad_bias_acc = at::zeros({vocab}, float_opts);
    scale = at::reciprocal(denominator.to(at::kFloat).reshape({1}));
  }
  const bool mixed_accumulate = hidden.is_cuda() && hidden.scalar_type() != at::kFloat;
  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t n = std::min(chunk, tokens - start);
    const auto h = hidden.narrow(0, start, n);
    at::Tensor logits = bias ? at::addmm(*bias, h, weight.t()) : at::mm(h, weight.t());
    loss_rows.narrow(0, start, n)
        .copy_(call_cross_entropy_rows(logits, targets.narrow(0, start, n), scale, ignore_index, label_smoothing,
                                       softcap));
    if (!compute_grad) continue;
    auto grad_h = grad_hidden.narrow(0, start, n);
    at::mm_out(grad_h, logits, weight);
    if (!want_weight) {
    } else if (mixed_accumulate) {  // bf16/fp16 operands, float32 accumulator, one cuBLAS call
      at::addmm_out(grad_weight_acc, grad_weight_acc, logits.t(), h, at::kFloat);
    } else {
      grad_weight_acc.add_(at::mm(logits.t(), h).to(at::kFloat));
    }
    if (bias) grad_bias_acc.add_(logits.sum(0, /*keepdim=*/false, at::kFloat));
  }
  const auto loss = loss_rows.sum() / denominator.to(at::kFloat).reshape({});
  const auto none = [&] { return at::empty({0}, hidden.options()); };  // a fixed output arity for tracing
  if (!compute_grad) return {loss, none(), none(), none()};
  return {loss, grad_hidden, want_weight ? grad_weight_acc.to(weight.scalar_type()) : at::empty({0}, weight.options()),
          bias ? grad_bias_acc.to(bias->scalar_type()) : none()};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CompositeExplicitAutograd, m) { m.impl("linear_cross_entropy", &linear_cross_entropy); }

}  // namespace hasten
