// CUDA hasten::varlen_meta: one kernel launch on the current stream, no host sync.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <tuple>

#include "../kernels/varlen_meta.cuh"
#include "hasten/cuda_glue.h"
#include "packing_checks.h"

namespace hasten {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_meta_cuda(const at::Tensor& position_ids) {
  check_device(position_ids, "varlen_meta", "position_ids", c10::DeviceType::CUDA);
  check_varlen_meta_args(position_ids);
  const c10::cuda::CUDAGuard guard(position_ids.device());
  const auto pos = position_ids.contiguous();
  const int64_t total = pos.numel();

  auto opts = pos.options().dtype(at::kInt);
  auto cu = at::empty({total + 1}, opts);
  auto seq_idx = at::empty({total}, opts);
  auto stats = at::empty({2}, opts);

  kernels::VarlenMetaParams params;
  params.position_ids = pos.data_ptr();
  params.position_ids_int64 = pos.scalar_type() == at::kLong;
  params.total = total;
  params.row_len = std::max<int64_t>(pos.size(-1), 1);
  params.cu_seqlens = cu.data_ptr<int32_t>();
  params.seq_idx = seq_idx.data_ptr<int32_t>();
  params.stats = stats.data_ptr<int32_t>();
  check_launch(kernels::launch_varlen_meta(params, c10::cuda::getCurrentCUDAStream()), "varlen_meta");
  return {cu, seq_idx, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) { m.impl("varlen_meta", &varlen_meta_cuda); }

}  // namespace hasten
