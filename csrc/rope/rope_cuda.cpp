// CUDA glue of hasten::rope: checks, device guard, one launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "../kernels/rope.cuh"
#include "hasten/cuda_glue.h"
#include "rope_checks.h"

namespace hasten {
namespace {

at::Tensor rope_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward,
                     bool interleaved) {
  check_device(x, "rope", "x", c10::DeviceType::CUDA);
  check_rope_args(x, cos, sin);
  const c10::cuda::CUDAGuard guard(x.device());
  // cos and sin share one layout for the kernel's indexing
  const auto c = cos.contiguous(), s = sin.contiguous();
  auto out = at::empty_like(x);  // x's strides (q and k arrive transposed)
  kernels::RopeParams p{};
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.cos = c.data_ptr();
  p.sin = s.data_ptr();
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.length = x.size(2);
  p.dim = x.size(3);
  p.rotary_dim = c.size(2);
  for (int i = 0; i < 3; ++i) {
    p.x_stride[i] = x.stride(i);
    p.out_stride[i] = out.stride(i);
  }
  p.cs_stride[0] = c.size(0) == 1 ? 0 : c.stride(0);
  p.cs_stride[1] = c.stride(1);
  p.backward = backward;
  p.interleaved = interleaved;
  p.type = element_type(x, "rope");
  p.cs_type = element_type(c, "rope");
  check_launch(kernels::launch_rope(p, c10::cuda::getCurrentCUDAStream()), "rope");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) { m.impl("rope", &rope_cuda); }

}  // namespace hasten
