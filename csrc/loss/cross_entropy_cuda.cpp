// CUDA glue of hasten::cross_entropy_rows_: checks, device guard, one launch on the current
// stream. No host sync: the gradient scale is read on the device, invalid targets give NaN.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../kernels/cross_entropy.cuh"
#include "hasten/cuda_glue.h"
#include "loss_checks.h"

namespace hasten {
namespace {

at::Tensor cross_entropy_rows_cuda(at::Tensor& logits, const at::Tensor& targets,
                                   const std::optional<at::Tensor>& grad_scale, int64_t ignore_index,
                                   double label_smoothing, double softcap) {
  check_device(logits, "cross_entropy_rows_", "logits", c10::DeviceType::CUDA);
  check_cross_entropy_rows_args(logits, targets, grad_scale, label_smoothing, softcap);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto tgt = targets.contiguous();
  const auto scale = grad_scale ? std::optional<at::Tensor>(grad_scale->contiguous()) : std::nullopt;
  auto loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  kernels::CrossEntropyRowsParams p;
  p.logits = logits.data_ptr();
  p.targets = tgt.data_ptr<int64_t>();
  p.loss = loss.data_ptr<float>();
  p.grad_scale = scale ? scale->data_ptr<float>() : nullptr;
  p.rows = logits.size(0);
  p.vocab = logits.size(1);
  p.ld = logits.stride(0);
  p.ignore_index = ignore_index;
  p.label_smoothing = static_cast<float>(label_smoothing);
  p.softcap = static_cast<float>(softcap);
  p.type = element_type(logits, "cross_entropy_rows_");
  check_launch(kernels::launch_cross_entropy_rows(p, c10::cuda::getCurrentCUDAStream()), "cross_entropy_rows_");
  return loss;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) { m.impl("cross_entropy_rows_", &cross_entropy_rows_cuda); }

}  // namespace hasten
