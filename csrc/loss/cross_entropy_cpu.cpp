// CPU reference of hasten::cross_entropy_rows_ (the CUDA kernel's contract, in plain loops).
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>

#include "loss_checks.h"

namespace hasten {
namespace {

at::Tensor cross_entropy_rows_cpu(at::Tensor& logits, const at::Tensor& targets,
                                  const std::optional<at::Tensor>& grad_scale, int64_t ignore_index,
                                  double label_smoothing, double softcap) {
  check_device(logits, "cross_entropy_rows_", "logits", c10::DeviceType::CPU);
  check_cross_entropy_rows_args(logits, targets, grad_scale, label_smoothing, softcap);
  const int64_t rows = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  const auto tgt = targets.contiguous();
  const int64_t* t = tgt.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(t[r] == ignore_index || (t[r] >= 0 && t[r] < vocab), "hasten::cross_entropy_rows_: target ",
                num(t[r]), " at row ", num(r), " is outside the vocabulary [0, ", num(vocab),
                ") and is not ignore_index (", num(ignore_index), "); check the labels and the tokenizer");
  }
  auto loss = at::zeros({rows}, logits.options().dtype(at::kFloat));
  float* out = loss.data_ptr<float>();
  const float scale = grad_scale ? grad_scale->item<float>() : 0.f;
  const double eps = label_smoothing, cap = softcap;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "cross_entropy_rows_cpu", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    std::vector<double> z(static_cast<size_t>(vocab));
    for (int64_t r = 0; r < rows; ++r) {
      scalar_t* row = base + r * ld;
      const bool ignored = t[r] == ignore_index;
      if (ignored) {
        if (grad_scale)
          for (int64_t j = 0; j < vocab; ++j) row[j] = scalar_t(0);
        continue;
      }
      double max = -std::numeric_limits<double>::infinity(), total = 0.0;
      for (int64_t j = 0; j < vocab; ++j) {
        const double x = static_cast<double>(row[j]);
        z[j] = cap > 0 ? cap * std::tanh(x / cap) : x;
        max = std::max(max, z[j]);
        total += z[j];
      }
      double sum = 0.0;
      for (int64_t j = 0; j < vocab; ++j) sum += std::exp(z[j] - max);
      const double lse = max + std::log(sum);
      out[r] = static_cast<float>(lse - (1.0 - eps) * z[t[r]] - eps / vocab * total);
      if (!grad_scale) continue;
      for (int64_t j = 0; j < vocab; ++j) {
        double g = std::exp(z[j] - lse) - eps / vocab - (j == t[r] ? 1.0 - eps : 0.0);
        if (cap > 0) g *= 1.0 - (z[j] / cap) * (z[j] / cap);
        row[j] = static_cast<scalar_t>(g * scale);
      }
    }
  });
  return loss;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) { m.impl("cross_entropy_rows_", &cross_entropy_rows_cpu); }

}  // namespace hasten
