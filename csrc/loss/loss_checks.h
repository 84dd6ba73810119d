// Argument checks of the loss ops (hasten::cross_entropy_rows_, hasten::linear_cross_entropy),
// shared by their CPU, CUDA and composite implementations.
#pragma once

#include <torch/types.h>

#include <optional>

#include "hasten/checks.h"

namespace hasten {

inline void check_cross_entropy_rows_args(const at::Tensor& logits, const at::Tensor& targets,
                                          const std::optional<at::Tensor>& grad_scale, double label_smoothing,
                                          double softcap) {
  const char* op = "cross_entropy_rows_";
  TORCH_CHECK(logits.dim() == 2, "hasten::", op, ": `logits` must be (rows, vocab), got shape ", shape(logits.sizes()));
  TORCH_CHECK(logits.stride(1) == 1, "hasten::", op, ": `logits` rows must be contiguous (stride 1 along vocab)");
  check_dtype(logits, op, "logits", {at::kFloat, at::kHalf, at::kBFloat16});
  check_dtype(targets, op, "targets", {at::kLong});
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0), "hasten::", op, ": `targets` must be (",
              num(logits.size(0)), ",) to match the logits rows, got shape ", shape(targets.sizes()));
  check_same_device(logits, targets, op, "logits", "targets");
  if (grad_scale) {
    TORCH_CHECK(grad_scale->numel() == 1 && grad_scale->scalar_type() == at::kFloat, "hasten::", op,
                ": `grad_scale` must be one float32 value (1 / the loss denominator)");
    check_same_device(logits, *grad_scale, op, "logits", "grad_scale");
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, "hasten::", op,
              ": `label_smoothing` must be in [0, 1], got ", std::to_string(label_smoothing));
  TORCH_CHECK(softcap >= 0.0, "hasten::", op, ": `softcap` must be 0 (off) or positive, got ", std::to_string(softcap));
}

inline void check_linear_cross_entropy_args(const at::Tensor& hidden, const at::Tensor& weight,
                                            const std::optional<at::Tensor>& bias, const at::Tensor& targets,
                                            const at::Tensor& denominator) {
  const char* op = "linear_cross_entropy";
  TORCH_CHECK(hidden.dim() == 2, "hasten::", op, ": `hidden` must be (tokens, hidden_size), got shape ",
              shape(hidden.sizes()), "; flatten the batch dimensions first");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1), "hasten::", op,
              ": `weight` must be (vocab, hidden_size=", num(hidden.size(1)), "), got shape ", shape(weight.sizes()));
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), "hasten::", op, ": `weight` is ", weight.scalar_type(),
              " but `hidden` is ", hidden.scalar_type(), "; the LM head and its input must share a dtype");
  check_dtype(hidden, op, "hidden", {at::kFloat, at::kHalf, at::kBFloat16});
  check_same_device(hidden, weight, op, "hidden", "weight");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == weight.scalar_type(),
                "hasten::", op, ": `bias` must be (vocab,) in the weight's dtype, got shape ", shape(bias->sizes()));
  }
  check_dtype(targets, op, "targets", {at::kLong});
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "hasten::", op, ": `targets` must be (",
              num(hidden.size(0)), ",), one per token, got shape ", shape(targets.sizes()));
  check_same_device(hidden, targets, op, "hidden", "targets");
  TORCH_CHECK(denominator.numel() == 1, "hasten::", op,
              ": `denominator` must hold one value (the number of target tokens the loss is averaged over)");
  check_same_device(hidden, denominator, op, "hidden", "denominator");
}

}  // namespace hasten
